"""`tidal serve --api-server-count 2 -dp 2`: two API server processes on one port, each reaching
both engine cores; /metrics aggregated over the servers (prometheus_client multiprocess mode).
A burst of 200 requests: every answer equals an in-process engine's, each engine serves 30-70%
of the tokens, /metrics sums them exactly, and each server's own share is in its file."""
from __future__ import annotations

import glob
import json
import os
from concurrent.futures import ThreadPoolExecutor

import psutil

try:
    from server_utils import Server, http_request
except ImportError:  # tests/ made a package
    from tests.server_utils import Server, http_request  # type: ignore[no-redef]

REQUESTS, TOKENS = 200, 5


def reference_texts(model: str, prompts: list[str]) -> list[str]:
    """Greedy texts of one in-process engine (the same checkpoint and engine args)."""
    from tidal.frontend import LLM
    from tidal.protocol import SamplingParams

    llm = LLM(model=model, max_model_len=256)
    try:
        sp = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
        return [o.outputs[0].text for o in llm.generate(prompts, sp, use_tqdm=False)]
    finally:
        llm.shutdown()


def test_two_api_servers_share_the_port_and_both_engines(tiny_model_dir: str, tidal_cache_dir: str) -> None:
    srv = Server(tiny_model_dir, ["--api-server-count", "2", "-dp", "2", "--served-model-name", "tiny",
                                  "--max-model-len", "256"], tidal_cache_dir)
    try:
        kids = psutil.Process(srv.proc.pid).children()
        servers = [p for p in kids if "tidal.frontend.entrypoints.cli" in " ".join(p.cmdline())]
        engines = [p for p in kids if "tidal.core.core_proc" in " ".join(p.cmdline())]
        assert len(servers) == 2 and len(engines) == 2

        prompts = [f"the sea {i} " * (1 + i % 7) for i in range(REQUESTS)]

        def one(prompt: str) -> str:
            body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0.0,
                               "ignore_eos": True}).encode()
            status, reply = http_request("POST", srv.url + "/v1/completions", body,
                                         {"Content-Type": "application/json", "Connection": "close"})
            assert status == 200, reply
            answer = json.loads(reply)
            assert answer["usage"]["completion_tokens"] == TOKENS
            return str(answer["choices"][0]["text"])

        with ThreadPoolExecutor(16) as pool:  # a burst
            texts = list(pool.map(one, prompts))
        assert texts == reference_texts(tiny_model_dir, prompts)  # every answer right
        metrics = srv.metrics()
        per_engine = [metrics[f'vllm:generation_tokens_total{{engine="{e}",model_name="tiny"}}'] for e in "01"]
        assert sum(per_engine) == REQUESTS * TOKENS, per_engine  # both servers counted
        assert all(0.3 <= n / (REQUESTS * TOKENS) <= 0.7 for n in per_engine), per_engine  # balanced

        # Each server's own counters, in its own file of the shared directory: both served.
        from prometheus_client.mmap_dict import MmapedDict

        metrics_dir = servers[0].environ()["PROMETHEUS_MULTIPROC_DIR"]
        served = {}
        for path in glob.glob(os.path.join(metrics_dir, "counter_*.db")):
            pid = int(path.rsplit("_", 1)[1].split(".")[0])
            values = MmapedDict.read_all_values_from_file(path)
            # A key is json.dumps((metric, sample name, label names, label values, help)).
            served[pid] = sum(v for key, v, *_ in values if json.loads(key)[1] == "vllm:generation_tokens_total")
        assert sorted(served) == sorted(p.pid for p in servers), served
        assert sum(served.values()) == REQUESTS * TOKENS and min(served.values()) > 0, served
    finally:
        srv.stop()
    assert not [p for p in kids if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
