"""What SGLang's model gateway reads from a worker, and a real gateway in front of one."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import openai
import pytest
from serving import serving

MODEL = "tiny-gateway-worker"


def test_worker_answers_the_gateways_metadata_probes(install, codec):
    with serving(install, codec, 3) as server:
        for path in ("/get_server_info", "/server_info"):
            info = httpx.get(server.base_url + path).json()
            assert info["served_model_name"] == info["model_path"] == MODEL
            assert (info["tp_size"], info["dp_size"], info["session_slots"]) == (1, 1, 3)
        for path in ("/get_model_info", "/model_info"):
            info = httpx.get(server.base_url + path).json()
            assert info["served_model_name"] == MODEL
            assert info["is_generation"] is True
            assert info["eos_token_ids"] == sorted(codec.eos_token_ids)


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_a_gateway_routes_to_the_worker_and_a_foreign_model_is_refused_in_one_line(
    install, codec, tmp_path
):
    pytest.importorskip("sglang_router")
    port = free_port()
    with serving(install, codec, 3) as server:
        gateway = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
             "--port", str(port), "--worker-urls", server.base_url, "--policy", "cache_aware",
             "--prometheus-port", str(free_port())],
            stdout=subprocess.DEVNULL, stderr=(tmp_path / "gateway.log").open("w"),
        )  # fmt: skip
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 240
            while True:
                try:
                    if httpx.get(f"{base}/v1/models", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                log = (tmp_path / "gateway.log").read_text()[-3000:]
                assert gateway.poll() is None and time.monotonic() < deadline, log
                time.sleep(0.25)
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="-", max_retries=0)
            messages = [{"role": "user", "content": "hello through the gateway"}]
            reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
            assert reply.usage.prompt_tokens > 0
            again = client.chat.completions.create(
                model=MODEL,
                messages=[*messages, {"role": "assistant", "content": reply.choices[0].message.content},
                          {"role": "user", "content": "and again"}],
                max_tokens=3,
            )  # fmt: skip
            assert again.usage.prompt_tokens_details.cached_tokens > 0  # the same worker kept it
            with pytest.raises(openai.NotFoundError) as refused:
                client.chat.completions.create(model="another-model", messages=messages)
            message = refused.value.body["message"]
            assert message.startswith("the model 'another-model' does not exist")
            assert f"serves '{MODEL}'" in message and "\n" not in message
        finally:
            gateway.terminate()
            gateway.wait(timeout=30)
