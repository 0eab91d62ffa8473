"""Compute the table behind ``03_at_scale.ipynb``: whole-model refit plans of DeepSeek-V3 and Kimi-K2 at
256 and 1024 GPUs (half trainer, half inference), and the cost model's predicted time of each.

Run ``python notebooks/at_scale_data.py`` (numpy only; about 2 minutes on 2 CPU cores), or
``python notebooks/at_scale_data.py kimi-k2:1024`` to recompute only the rows named and keep the others.
It writes ``notebooks/at_scale.json``, which the notebook reads. Every time in it is a prediction of the cost
model (``jreshard.cost.predict``), never a measurement.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import platform
import subprocess
import sys
import time

import jreshard
from jreshard.cost import predict
from jreshard.models import refit, refit_topology

OUT = pathlib.Path(__file__).with_name("at_scale.json")
CONFIGS = [(m, n) for n in (256, 1024) for m in ("deepseek-v3", "kimi-k2")]
# The CLI's `--cluster nvl72` preset: GB200 NVL72 racks of 72 GPUs, 50 GB/s NIC and 900 GB/s NVLink per GPU
# each way, as in the published NCCL M2N numbers.
DOMAIN = 72
LINKS = {"network_bw": 50e9, "fast_bw": 900e9}
# The baselines under the CLI's names. "gather-broadcast (ring)" is gather_broadcast(ring=True): each full tensor
# goes down a chain of destinations, as NCCL broadcasts, rather than from one sender to each destination.
KINDS = {
    "jreshard": jreshard.plan,
    "gather-broadcast (ring)": lambda s, d, t: jreshard.baselines.gather_broadcast(s, d, t, ring=True),
    "flat-direct": jreshard.baselines.flat_direct,
}


def one(model: str, n_gpus: int) -> dict:
    half = n_gpus // 2
    r = refit(model, half, half)
    topo = refit_topology(half, half, domain_size=DOMAIN, **LINKS)
    src, dst = [s for s, _ in r.pairs], [d for _, d in r.pairs]
    row = {
        "model": model,
        "n_gpus": n_gpus,
        "n_train": half,
        "n_infer": half,
        "domain_size": DOMAIN,
        "links": dataclasses.asdict(topo.links),
        "trainer": r.trainer.name,
        "inference": r.inference.name,
        "tensors": len(r.pairs),
        "model_bytes": r.model.nbytes,
        "plans": {},
    }
    for kind, make in KINDS.items():
        t0 = time.perf_counter()
        p = make(src, dst, topo)
        pred = predict(p, topo)
        s = p.stats()
        row["plans"][kind] = {
            "predicted_s": pred.seconds,
            "predicted_bound_s": pred.bound_seconds,
            "bottleneck": None if pred.bottleneck_port is None else pred.bottleneck_port.label,
            "network_bytes": s.network_bytes,
            "network_bytes_lower_bound": s.network_bytes_lower_bound,
            "fast_bytes": s.fast_bytes,
            "max_rank_network_send_bytes": s.max_rank_network_send_bytes,
            "max_rank_network_recv_bytes": s.max_rank_network_recv_bytes,
            "messages": s.messages,
            "compute_s": round(time.perf_counter() - t0, 1),
        }
        print(
            f"{model} {n_gpus} {kind}: predicted {pred.seconds:.3f} s ({row['plans'][kind]['compute_s']} s to plan)",
            flush=True,
        )
        del p
    return row


def main(only: list[str]) -> None:
    """Compute every row (or only the rows named ``model:n_gpus`` in ``only``, keeping the others)."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    old = {(r["model"], r["n_gpus"]): r for r in json.loads(OUT.read_text())["rows"]} if only and OUT.exists() else {}
    data = {
        "command": "python notebooks/at_scale_data.py",
        "jreshard": jreshard.__version__,
        "git": commit,
        "python": platform.python_version(),
        "rows": [],
    }
    for model, n in CONFIGS:
        keep = old.get((model, n)) if f"{model}:{n}" not in only else None
        data["rows"].append(keep or one(model, n))
        OUT.write_text(json.dumps(data, indent=1))
    print("wrote", OUT, file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
