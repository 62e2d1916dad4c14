"""`tidal serve --api-server-count 2 -dp 2`: two API server processes on one port, each reaching
both engine cores; /metrics aggregated over the servers (prometheus_client multiprocess mode).
Checked against exact counts: every request's tokens, their sum in /metrics, and each server's
own share in its multiprocess file."""
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

REQUESTS, TOKENS = 32, 5


def test_two_api_servers_share_the_port_and_both_engines(tiny_model_dir: str, tidal_cache_dir: str) -> None:
    srv = Server(tiny_model_dir, ["--api-server-count", "2", "-dp", "2", "--served-model-name", "tiny",
                                  "--max-model-len", "256"], tidal_cache_dir)
    try:
        kids = psutil.Process(srv.proc.pid).children()
        servers = [p for p in kids if "tidal.frontend.entrypoints.cli" in " ".join(p.cmdline())]
        engines = [p for p in kids if "tidal.core.core_proc" in " ".join(p.cmdline())]
        assert len(servers) == 2 and len(engines) == 2

        def one(i: int) -> int:
            body = json.dumps({"model": "tiny", "prompt": f"the sea {i}", "max_tokens": TOKENS, "temperature": 0.0,
                               "ignore_eos": True}).encode()
            status, reply = http_request("POST", srv.url + "/v1/completions", body,
                                         {"Content-Type": "application/json", "Connection": "close"})
            assert status == 200, reply
            return int(json.loads(reply)["usage"]["completion_tokens"])

        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(one, range(REQUESTS))) == [TOKENS] * REQUESTS
        metrics = srv.metrics()
        per_engine = [metrics[f'vllm:generation_tokens_total{{engine="{e}",model_name="tiny"}}'] for e in "01"]
        assert sum(per_engine) == REQUESTS * TOKENS and min(per_engine) > 0, per_engine  # both servers counted

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
