"""The headline numbers of a run and the tables printed for people.

    uv run python -m bench.report bench/results/cpu      # print a results folder again

A folder holds one file a section and family, as ``python -m bench.run``
writes them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# bench.concurrency.ConcurrencyPlan's default chat: turns, and tokens a reply.
DEFAULT_CHAT = (3, 64)


def chat_shape(settings: dict[str, Any]) -> tuple[int, int]:
    """A concurrency result's chat shape: its turns and tokens a reply."""
    return settings.get("turns", DEFAULT_CHAT[0]), settings.get("reply_tokens", DEFAULT_CHAT[1])


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


def print_family(family: str, res: dict[str, Any]) -> None:
    """The human-readable table of one family's sections (those present in *res*)."""
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


def print_quantized(result: dict[str, Any]) -> None:
    """One line per size and width: decode, prefill and memory against mlx-lm."""
    for size, by_size in result.items():
        for name, row in by_size["rows"].items():
            fwd, mem = row["forward"], row["memory"]
            ours = fwd["engines"]["ours_generate"]
            line = (
                f"{size:<6} {name:<5} decode {ours['decode_tok_s']:8.1f} tok/s "
                f"x{fwd['generate_decode_ratio_vs_mlx_lm']:.2f} mlx-lm "
                f"({row['decode_vs_float']:.2f} of float), prefill "
                f"x{fwd['generate_prefill_ratio_vs_mlx_lm']:.2f}, weights "
                f"{mem['ours']['loaded_bytes'] / 1e9:.2f} GB "
                f"(x{row['loaded_memory_ratio_vs_mlx_lm']:.3f}), peak "
                f"x{row['peak_memory_ratio_vs_mlx_lm']:.3f}"
            )
            for n, level in row.get("concurrency", {}).get("levels", {}).items():
                if "tok_s_ratio" in level:
                    line += f", N={n} x{level['tok_s_ratio']:.2f}"
            print(line)


def print_section(section: str, family: str, result: dict[str, Any]) -> None:
    """One finished section of ``bench.run``, printed as it ends."""
    if section in ("forward", "interleaved", "serving", "concurrency", "server_step", "swap",
                   "dispatch", "draft", "experts"):  # fmt: skip
        print_family(family, {section: result})
        return
    print(f"\n== {family} {section}")
    if section == "constrain":
        print_constrain(result)
    elif section == "batch_decode":
        from bench.batch_decode import summary

        print(*summary(result), sep="\n")
    elif section == "steering":
        print(
            f"decode ratio, steered / off: add {result['decode_ratio_add']:.3f}, "
            f"renorm {result['decode_ratio_renorm']:.3f}"
        )
    elif section == "step_cost":
        for r in result["rows"]:
            print(
                f"B={r['batch']}: wall {r['wall_ms_per_step']:.2f} ms a step (host "
                f"{r['host_ms_per_step']:.2f}), mlx-lm BatchGenerator "
                f"{r['mlx_lm']['wall_ms_per_step']:.2f}: ratio {r['wall_ratio_vs_mlx_lm']:.2f}"
            )
    elif section == "session_disk":
        for r in result["rows"]:
            print(
                f"history {r['history_tokens']:6d}: reload {r['reload_ms']:8.1f} ms, re-prefill "
                f"{r['reprefill_ms']:8.1f} ms (x{r['reload_speedup']:.1f}), "
                f"{r['bytes_per_token']:.0f} B/token"
            )
    elif section == "host_cost":
        for name, r in result.items():
            print(f"{name:<16} {r['cpu_us']:7d} us to build a step, rounds {r['cpu_us_rounds']}")
    elif section == "replicas":
        from bench.replicas import print_summary

        print_summary(result)
    elif section == "quantized":
        print_quantized(result)
    elif section == "startup":
        for kind in ("turbospark", "mlx_lm"):
            r = result[kind]
            print(
                f"{kind:<10} ready {r['ready_s']:.2f} s, first token {r['first_token_s']:.2f} s "
                f"(its request's TTFT {r['first_request_ttft_s']:.3f} s), median of {result['reps']}"
            )
        print(f"launch to first token, mlx_lm ÷ ours: {result['first_token_ratio']:.2f}")
    elif section == "long_context":
        from bench.long_context import summary as long_context_summary

        print(*long_context_summary(result), sep="\n")
    elif section == "prefill_cost":
        print(sorted(result))
        for figure, value, spread in figures(section, result):
            print(f"{figure}: {value} ({spread})")
    else:
        keys = {k: v for k, v in result.items() if isinstance(v, int | float | str)}
        print(keys or sorted(result))


def _spread(values: list[float]) -> str:
    return f"{min(values):.2f}–{max(values):.2f}"


def figures(section: str, result: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The headline figures of one section: (figure, value, spread) rows for
    docs/PERFORMANCE.md; ratios above 1 favour turbospark."""
    rows: list[tuple[str, str, str]] = []
    if section == "forward":
        for size, f in result.items():
            for label, key in (("hand loop", ""), ("library loops", "generate_")):
                for phase in ("prefill", "decode"):
                    reps = f.get(f"{key}{phase}_ratio_reps")
                    rows.append((
                        f"{size}: {phase} tok/s ÷ mlx-lm, {label}",
                        f"{f[f'{key}{phase}_ratio_vs_mlx_lm']:.2f}",
                        f"{_spread(reps)} over {len(reps)} reps" if reps else "",
                    ))  # fmt: skip
    elif section == "interleaved":
        rows.append(("pool ÷ one slot, wall time of the chats", f"{result['speedup_vs_no_pool']:.2f}",
                     f"{result['prefill_tokens_saved']} prefill tokens saved"))  # fmt: skip
    elif section == "serving" and "ttft_ratio_vs_mlx_lm_server" in result:
        turns = zip(result["turbospark"]["turns"], result["mlx_lm"]["turns"], strict=True)
        ratios = [t["ttft_s"] / o["ttft_s"] for o, t in turns]
        rows.append(("TTFT, mlx_lm.server ÷ turbospark serve (median turn)",
                     f"{result['ttft_ratio_vs_mlx_lm_server']:.2f}",
                     f"{_spread(ratios)} over {len(ratios)} turns"))  # fmt: skip
    elif section == "swap":
        r = result["rows"][-1]
        hit = f", mlx-lm cache hit {r['mlx_lm_cache_hit_ms']:.2f} ms" if "mlx_lm_cache_hit_ms" in r else ""  # fmt: skip
        rows.append((f"swap a parked {r['history_tokens']}-token session in, ms",
                     f"{r['swap_ms']:.3f}", f"re-prefill {r['reprefill_ms']:.0f} ms{hit}"))  # fmt: skip
    elif section == "session_disk":
        r = result["rows"][-1]
        rows.append((f"reload a {r['history_tokens']}-token session from disk, ms",
                     f"{r['reload_ms']:.1f}",
                     f"re-prefill {r['reprefill_ms']:.0f} ms ({r['reload_speedup']:.0f}x)"))  # fmt: skip
    elif section == "dispatch":
        us = result["per_token_us"]
        rows.append(("µs a token: hook path, runner, over a direct call",
                     f"{result['hook_overhead_us']:.0f}, {result['runner_overhead_us']:.0f}",
                     f"direct {us['direct']:.0f} µs a token"))  # fmt: skip
    elif section == "steering":
        for mode in ("add", "renorm"):
            e = result["engines"]
            rows.append((f"decode tok/s, every layer steered ({mode}) ÷ off",
                         f"{result[f'paired_decode_ratio_{mode}']:.2f}",
                         f"tok/s (max − min) ÷ median over reps: {e[mode]['spread']:.2f} steered, {e['off']['spread']:.2f} off"))  # fmt: skip
    elif section == "step_cost":
        for r in result["rows"]:
            rows.append((f"batched decode step, B={r['batch']}: mlx-lm ÷ ours, wall ms",
                         f"{r['wall_ratio_vs_mlx_lm']:.2f}",
                         f"{r['wall_ms_per_step']:.1f} vs {r['mlx_lm']['wall_ms_per_step']:.1f} ms"))  # fmt: skip
    elif section == "host_cost":
        ours, theirs = result["ours"], result["mlx_lm"]
        rows.append(("host µs to build a decode step: mlx-lm ÷ ours",
                     f"{theirs['cpu_us'] / ours['cpu_us']:.2f}",
                     f"{ours['cpu_us']} vs {theirs['cpu_us']} µs (least of rounds {ours['cpu_us_rounds']}, "
                     f"{theirs['cpu_us_rounds']})"))  # fmt: skip
    elif section == "concurrency":
        # --append-replies: each turn re-sends the reply as received, so the
        # servers' prompts differ by what they replied; say by how much.
        settings = result["settings"]
        shape = chat_shape(settings)
        mode = f", {shape[0]} turns × {shape[1]} tokens" * (shape != DEFAULT_CHAT)
        mode += ", replies re-sent" * bool(settings.get("append_replies"))
        for n, level in result["levels"].items():
            if "tok_s_ratio" not in level:
                rows.append((f"N={n} clients{mode}", "no ratio", level["ratio_refused"]))
                continue
            a, b = level["turbospark"], level["mlx_lm"]
            given = (f"; prompt tokens ours ÷ theirs {level['prompt_tokens_ratio']:.2f}"
                     if "prompt_tokens_ratio" in level else "")  # fmt: skip
            per_rep = level.get("tok_s_ratio_per_rep", [])
            spread = f"; {_spread(per_rep)} over {len(per_rep)} reps" if len(per_rep) > 1 else ""
            rows.append((f"N={n} clients{mode}: completion tok/s ÷ mlx_lm.server", f"{level['tok_s_ratio']:.2f}",
                         f"{a['completion_tok_s']:.0f} vs {b['completion_tok_s']:.0f} tok/s{spread}{given}"))  # fmt: skip
            rows.append((f"N={n} clients{mode}: TTFT p50, mlx_lm.server ÷ ours", f"{1 / level['ttft_p50_ratio']:.2f}",
                         f"{a['ttft_p50_s'] * 1e3:.0f} vs {b['ttft_p50_s'] * 1e3:.0f} ms"))  # fmt: skip
    elif section == "startup":
        a, b = result["turbospark"], result["mlx_lm"]
        rows.append(("launch to first streamed token: mlx_lm.server ÷ ours",
                     f"{result['first_token_ratio']:.2f}",
                     f"{a['first_token_s']:.1f} vs {b['first_token_s']:.1f} s (ready {a['ready_s']:.1f} vs "
                     f"{b['ready_s']:.1f} s); per launch {_spread(result['first_token_ratio_per_rep'])}"))  # fmt: skip
    elif section == "experts":
        for name, r in result["engines"].items():
            rows.append((f"expert cache {name}: decode tok/s ÷ every expert resident",
                         f"{r['decode_vs_all']:.2f}",
                         f"hit rate {r['hit_rate']:.0%}, {r['resident_fraction']:.0%} of the expert bytes "
                         f"resident, same tokens: {r['same_tokens_as_all']}"))  # fmt: skip
    elif section == "draft":
        from bench.draft import summary

        d = summary(result)
        same = all(p["output_equals_off"] for p in result["curve"])
        rows.append((f"drafts all accepted, depth {d['draft_full_acceptance_depth']}: tok/s ÷ off",
                     f"{d['draft_full_acceptance_speedup']:.2f}",
                     f"oracle drafter; every output equals off's: {same}"))  # fmt: skip
        rows.append(("drafts never accepted, worst depth: tok/s ÷ off",
                     f"{d['draft_zero_acceptance_worst_speedup']:.2f}", "adaptive depth"))  # fmt: skip
        if ngram := result.get("ngram_copy"):
            rows.append(("prompt lookup on a copy-heavy prompt: tok/s ÷ off",
                         f"{ngram['tok_s'] / ngram['off_tok_s']:.2f}", ""))  # fmt: skip
    elif section == "prefill_cost":
        for size, h in result.get("held", {}).items():
            for r in h["rows"]:
                rows.append((f"{size}: prefill of {h['new_tokens']} tokens over {r['held']} held, "
                             "mlx-lm generate_step's time ÷ ours", f"{r['ratio']:.2f}",
                             f"{_spread(r['ratio_reps'])} over {len(r['ratio_reps'])} reps; "
                             f"{r['ours_ms']:.0f} vs {r['mlx_lm_ms']:.0f} ms"))  # fmt: skip
    elif section == "long_context":
        for r in result["rows"]:
            ours, theirs = r["engines"]["ours"], r["engines"]["mlx_lm"]
            n = r["prompt_tokens"]
            rows.append((f"{n}-token prompt: library decode tok/s ÷ mlx-lm", f"{r['decode_ratio_vs_mlx_lm']:.2f}",
                         f"{ours['decode_tok_s']:.0f} vs {theirs['decode_tok_s']:.0f} tok/s; slowest step "
                         f"÷ median {ours['max_over_median_step']:.2f} vs {theirs['max_over_median_step']:.2f}"))  # fmt: skip
            rows.append((f"{n}-token prompt: peak memory ÷ mlx-lm's", f"{r['peak_memory_ratio_vs_mlx_lm']:.2f}",
                         f"{_mib(ours['peak_bytes'])} vs {_mib(theirs['peak_bytes'])} MiB; "
                         f"same tokens: {r['tokens_match']}"))  # fmt: skip
    elif section == "batch_decode":
        for key, level in result["levels"].items():
            rows.append((f"qwen4_exp {key}: batched ÷ row by row tok/s", f"{level['ratio']:.2f}",
                         f"{level['batched_tok_s']:.0f} vs {level['row_by_row_tok_s']:.0f} tok/s"))  # fmt: skip
    return rows


def load(folder: Path) -> dict[str, dict[str, Any]]:
    """Every result file of *folder*, by file stem."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def print_tables(rows: dict[str, dict[str, Any]]) -> None:
    """docs/PERFORMANCE.md's tables: one a family, each figure with the command
    that reproduces it (a result carried with its run's other processes takes
    its spread from them)."""
    by_family: dict[str, list[dict[str, Any]]] = {}
    for row in rows.values():
        by_family.setdefault(row["family"], []).append(row)
    for family, family_rows in sorted(by_family.items(), key=lambda kv: kv[0] == "-"):
        print(f"\n{'Once a run' if family == '-' else family}:\n")
        print("| figure | value | spread, detail | reproduce |\n|---|---|---|---|")
        for row in family_rows:
            device = "gpu" if row["plan"] == "gpu" else "cpu"
            command = f"`--device {device} --only {row['section']}" + (
                f" --family {family}" if family != "-" else ""
            )
            settings = row["result"].get("settings", {}) if row["section"] == "concurrency" else {}
            shape = chat_shape(settings)
            if settings.get("append_replies") or shape != DEFAULT_CHAT or (settings and device == "gpu"):  # fmt: skip
                # the flags that chose its clients and mode (a GPU lease runs one level a command)
                command += "".join(f" --concurrency-clients {n}" for n in settings["clients"])
                command += " --append-replies" * bool(settings.get("append_replies"))
                for flag, value, default in zip(
                    ("turns", "reply-tokens"), shape, DEFAULT_CHAT, strict=True
                ):
                    command += f" --concurrency-{flag} {value}" * (value != default)
                reps = settings.get("reps", 1)
                command += f" --concurrency-reps {reps}" * (reps > 1)
            command += "`"
            others = [figures(row["section"], p) for p in row.get("processes", [])]
            for i, (figure, value, detail) in enumerate(figures(row["section"], row["result"])):
                if others:
                    values = [float(o[i][1]) for o in others]
                    detail = f"{_spread(values)} over {len(values)} processes"
                print(f"| {figure} | {value} | {detail} | {command} |")


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--table", action="store_true", help="headline figures, as markdown")
    args = parser.parse_args(argv)
    rows = load(args.folder)
    if args.table:
        print_tables(rows)
        return 0
    machines = {json.dumps(r["machine"], sort_keys=True) for r in rows.values()}
    for m in machines:
        print("machine:", m)
    for row in rows.values():
        print_section(row["section"], row["family"], row["result"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
