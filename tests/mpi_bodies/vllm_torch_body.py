"""A JAX trainer refits a PyTorch vLLM-style server over MPI (one MPMD mpiexec): ``vllm_torch_body.py
trainer`` (one process, 2 devices, FSDP float32) and ``vllm_torch_body.py server`` (two processes: vLLM's TP
ranks 0 and 1, bfloat16 torch tensors, jax blocked). Three versions, every tensor bit for bit against a numpy
re-enactment of vLLM's weight loaders."""

import sys
from pathlib import Path

from _common import main, push_versions

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for _vllm_reference

CFG = dict(vocab_size=200, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=1,
           head_dim=8)  # fmt: skip
VERSIONS = (1, 2, 3)


def trainer_side() -> dict:
    import jax
    import numpy as np
    from _vllm_reference import trainer
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jreshard.integrations import vllm

    model = vllm.DecoderShape(**CFG)
    mesh = Mesh(np.array(jax.devices()[:2]), ("fsdp",))

    def params(v: int) -> dict:
        return {k: jax.device_put(a, NamedSharding(mesh, P("fsdp"))) for k, a in trainer(model, seed=v).items()}

    return push_versions(params, VERSIONS)


def server_side() -> dict:
    sys.modules["jax"] = None  # a PyTorch server: any import of jax from here on raises
    import numpy as np
    import torch
    from _vllm_reference import hf_names, trainer, vllm_rank
    from mpi4py import MPI

    from jreshard import Options
    from jreshard.integrations import vllm
    from jreshard.torch.receiver import Receiver

    model = vllm.DecoderShape(**CFG)
    rank = MPI.COMM_WORLD.Get_rank() - 1  # the trainer is world rank 0
    tensors = {
        n: torch.zeros(s.tensor_shape, dtype=torch.bfloat16) for n, s in vllm.vllm_shards(model, rank, 2).items()
    }
    shards, recipe = vllm.receiver_shards(tensors, model, rank, 2)
    rx = Receiver.over_mpi(shards, recipe=recipe, options=Options(timeout_s=60.0))
    exact = []
    for _ in VERSIONS:
        v = rx.pull()
        want = vllm_rank(model, hf_names(model, trainer(model, seed=v)), rank, 2)
        exact.append(
            all(
                torch.equal(torch.from_numpy(np.ascontiguousarray(want[n])).to(torch.bfloat16).view(torch.int16),
                            t.view(torch.int16))
                for n, t in tensors.items()
            )
        )  # fmt: skip
    rx.close()
    return {"exact": exact, "version": rx.version, "loaded": sorted(m for m in sys.modules if m.startswith("jax."))}


if __name__ == "__main__":
    side = sys.argv[1]
    main(f"vllm-{side}", trainer_side if side == "trainer" else server_side)
