"""The headline numbers of a run and the table printed for people."""

from __future__ import annotations

from typing import Any


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """Per-family summary keys. Forward ratios come from the largest size run
    (``ratios_from_size`` says which); the pool and server keys from the chat workload."""
    out: dict[str, Any] = {}
    if forward := result.get("forward"):
        size = list(forward)[-1]
        out["ratios_from_size"] = size
        out["prefill_ratio_vs_mlx_lm"] = forward[size]["prefill_ratio_vs_mlx_lm"]
        out["decode_ratio_vs_mlx_lm"] = forward[size]["decode_ratio_vs_mlx_lm"]
    if interleaved := result.get("interleaved"):
        out["speedup_vs_no_pool"] = interleaved["speedup_vs_no_pool"]
        out["prefill_tokens_saved"] = interleaved["prefill_tokens_saved"]
    if serving := result.get("serving"):
        out["ttft_ratio_vs_mlx_lm_server"] = serving.get("ttft_ratio_vs_mlx_lm_server")
    if steering := result.get("steering"):
        out["steering_decode_ratio_add"] = steering["decode_ratio_add"]
        out["steering_decode_ratio_renorm"] = steering["decode_ratio_renorm"]
    if concurrency := result.get("concurrency"):
        widest = max(concurrency["levels"], key=int)
        level = concurrency["levels"][widest]
        out["concurrency_clients"] = int(widest)
        out["concurrency_tok_s_ratio_vs_mlx_lm_server"] = level.get("tok_s_ratio")
        out["concurrency_ttft_p50_ratio_vs_mlx_lm_server"] = level.get("ttft_p50_ratio")
    if (step := result.get("server_step")) and "error" not in step:
        out["server_step_over_engine_step"] = step["server_over_engine"]
    if draft := result.get("draft"):
        from bench.draft import summary

        out.update(summary(draft))
    return out


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def print_constrain(result: dict[str, Any]) -> None:
    print(f"\n== constrained decoding, vocabulary {result['vocab_size']}")
    for library in ("llguidance", "xgrammar"):
        r = result[library]
        if "error" in r:
            print(f"{library}: {r['error']}")
            continue
        for name in ("json_schema", "json_object"):
            c = r[name]
            print(
                f"{library:<10} {r['version']:<7} {name:<11} compile {c['compile_s'] * 1e3:7.1f} ms  "
                f"mask {c['mask_us']:7.1f} us/token  step {c['step_us']:7.1f} us/token  "
                f"({c['tokens']} tokens, {'accepting' if c['accepting'] else 'NOT accepting'})"
            )


def print_table(report: dict[str, Any]) -> None:
    m = report["machine"]
    print(
        f"machine: {m['cpu_model']}, {m['cores']} cores, {m['device']}, {m['blas']}; "
        f"mlx {m['mlx']}, mlx-lm {m['mlx_lm']}; dtype {report['dtype']}; {report['mode']} run "
        f"({report['wall_s']:.0f} s)"
    )
    for family, res in report["families"].items():
        print(f"\n== {family}")
        for size, f in res.get("forward", {}).items():
            e = f["engines"]
            print(
                f"forward {size:<6} prefill tok/s ours {e['ours']['prefill_tok_s']:8.0f}  mlx-lm "
                f"{e['mlx_lm']['prefill_tok_s']:8.0f}  ratio {f['prefill_ratio_vs_mlx_lm']:.2f} | "
                f"decode tok/s ours {e['ours']['decode_tok_s']:6.1f}  mlx-lm "
                f"{e['mlx_lm']['decode_tok_s']:6.1f}  ratio {f['decode_ratio_vs_mlx_lm']:.2f}"
            )
            if "ours_generate" in e:
                g, t = e["ours_generate"], e["mlx_lm_generate_step"]
                print(
                    f"  generate loops: prefill tok/s stream_generate {g['prefill_tok_s']:8.0f}  "
                    f"generate_step {t['prefill_tok_s']:8.0f} | decode tok/s "
                    f"{g['decode_tok_s']:6.1f} vs {t['decode_tok_s']:6.1f}"
                )
        if inter := res.get("interleaved"):
            p, n = inter["pool"], inter["no_pool"]
            print(
                f"interleaved {inter['conversations']}x{inter['turns']} in process: pool "
                f"{p['total_s']:.2f} s, {p['prefill_tokens']} prefill tokens | no pool "
                f"{n['total_s']:.2f} s, {n['prefill_tokens']} prefill tokens | speedup "
                f"{inter['speedup_vs_no_pool']:.2f}x, saved {inter['prefill_tokens_saved']} tokens"
            )
        if serving := res.get("serving"):
            o, t = serving["turbospark"], serving["mlx_lm"]
            print(
                f"HTTP: turbospark serve {o['total_s']:.2f} s, {o['prefill_tokens']} prefill tokens | "
                f"mlx_lm.server {t['total_s']:.2f} s, {t['prefill_tokens']} prefill tokens | "
                + (
                    f"TTFT theirs/ours (median over turns) {serving['ttft_ratio_vs_mlx_lm_server']:.2f}"
                    if serving["same_prompt_tokens"]
                    else f"no ratio: {serving['ratio_refused']}"
                )
            )
            print("  turn  history  TTFT ms ours  TTFT ms mlx-lm")
            for a, b in zip(o["turns"], t["turns"], strict=True):
                print(
                    f"  {a['conversation']}.{a['turn']:<3} {a['prompt_tokens']:8d} "
                    f"{a['ttft_s'] * 1e3:13.1f} {b['ttft_s'] * 1e3:15.1f}"
                )
        if concurrency := res.get("concurrency"):
            from bench.concurrency import summary

            c = concurrency["settings"]
            first = concurrency["first_request_ttft_s"]
            print(
                f"concurrency: {c['turns']}-turn chats, {c['reply_tokens']} tokens a reply; first "
                f"request TTFT ours {first['turbospark'] * 1e3:.0f} ms, mlx_lm.server "
                f"{first['mlx_lm'] * 1e3:.0f} ms"
            )
            for line in summary(concurrency):
                print("  " + line)
        if step := res.get("server_step"):
            from bench.server_step import summary as step_summary

            print("server step: " + (step.get("error") or step_summary(family, step)))
        if swap := res.get("swap"):
            print(
                "swap: history  swap ms  (scoring ms/record)  reset ms  re-prefill ms  "
                "session MiB  active-mem growth MiB  mem change across swaps"
                + ("  mlx-lm cache hit ms" if "mlx_lm_cache_hit_ms" in swap["rows"][0] else "")
            )
            for r in swap["rows"]:
                line = (
                    f"      {r['history_tokens']:7d} {r['swap_ms']:8.3f} {r['scoring_ms_per_record']:14.3f}"
                    f" {r['reset_ms']:15.3f} {r['reprefill_ms']:13.1f} {_mib(r['session_nbytes']):>12}"
                    f" {_mib(r['active_memory_growth_bytes']):>21} {r['active_memory_change_across_swaps_bytes']:>12d} B"
                )
                if "mlx_lm_cache_hit_ms" in r:
                    line += f" {r['mlx_lm_cache_hit_ms']:18.2f}"
                print(line)
        if d := res.get("dispatch"):
            us = d["per_token_us"]
            print(
                f"dispatch per token (tiny model): direct {us['direct']:.0f} us, hook "
                f"{us['hook']:.0f} us, runner {us['runner']:.0f} us | pluggy call "
                f"{d['pluggy_call_us']:.2f} us vs plain call {d['plain_call_us']:.2f} us"
            )
        if draft := res.get("draft"):
            from bench.draft import print_curve

            print_curve(family, draft)
        if experts := res.get("experts"):
            from bench.experts import print_experts

            print_experts(experts)
