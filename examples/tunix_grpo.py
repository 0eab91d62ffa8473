"""GRPO with Tunix on 8 CPU devices, the actor and the rollout on different meshes, weights synced by jreshard.

Tunix's toy transformer is trained by ``GRPOLearner``; its actor (trainer) lives on devices 0-3 as FSDP4, its
rollout (sampler) on devices 4-7 as TP4. ``jreshard.integrations.tunix.install()`` makes every weight sync
(``RLCluster.sync_weights``) and every model load onto a mesh go through jreshard. At each of those calls this
script also runs ``jax.device_put`` on the same source and shardings, checks the two results are equal shard by
shard, and times both: the printed times come from the same run, call by call. (Tunix syncs under
``disallow_explicit`` host-to-device guards on CPU, where ``device_put`` between shardings of different devices
goes through the host and is refused: the reference runs with the guard lifted, jreshard under it.)

  JAX_PLATFORMS=cpu .venv/bin/python examples/tunix_grpo.py [--lora] [--steps 4]

Needs ``pip install 'jreshard[tunix]'``.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import qwix
from flax import nnx
from tunix.rl import reshard
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner as grpo_lib
from tunix.rl.rollout import base_rollout
from tunix.tests import test_common as tc

from jreshard.integrations import tunix as jreshard_tunix

PROMPTS = ["input string", "hello world", "My name", "hello there"]


def _equal(a, b) -> bool:
    """Same tree, and per leaf the same sharding and the same bytes on every device."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    for x, y in zip(la, lb, strict=True):
        if x.sharding != y.sharding or x.dtype != y.dtype:
            return False
        theirs = {s.device: s for s in y.addressable_shards}
        for s in x.addressable_shards:
            t = theirs[s.device]
            if s.index != t.index or not np.array_equal(np.asarray(s.data), np.asarray(t.data)):
                return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters (the syncs move only those)")
    parser.add_argument("--steps", type=int, default=4, help="GRPO training steps (one weight sync each)")
    args = parser.parse_args()

    devices = sorted(jax.devices(), key=lambda d: d.id)
    actor_mesh = jax.sharding.Mesh(np.array(devices[:4]).reshape(4, 1), ("fsdp", "tp"))
    rollout_mesh = jax.sharding.Mesh(np.array(devices[4:]).reshape(1, 4), ("fsdp", "tp"))

    jreshard_tunix.install()
    calls: list[dict] = []

    def timed(source, target, *rest, **kwargs):
        """The installed entry point, timed, beside jax.device_put of the same call (timed, and compared)."""
        t0 = time.perf_counter()
        out = jax.block_until_ready(jreshard_tunix.reshard_pytree(source, target, *rest, **kwargs))
        t1 = time.perf_counter()
        with jax.transfer_guard("allow"):
            shardings = jax.tree.map(lambda t: t if isinstance(t, jax.sharding.Sharding) else t.sharding, target)
            t2 = time.perf_counter()
            want = jax.block_until_ready(jax.device_put(source, shardings))
            t3 = time.perf_counter()
            exact = _equal(out, want)
        leaves = len(jax.tree.leaves(out))
        calls.append({"jreshard_s": t1 - t0, "device_put_s": t3 - t2, "exact": exact, "leaves": leaves})
        return out

    reshard.reshard_pytree = timed  # (still jreshard's function inside: install() put it there)

    vocab = tc.MockVocab()
    config = tc.ModelConfig(vocab_size=vocab.GetPieceSize())
    reference = tc.ToyTransformer(config=config, rngs=nnx.Rngs(0))
    actor = tc.ToyTransformer(config=config, rngs=nnx.Rngs(0))
    if args.lora:
        provider = qwix.LoraProvider(module_path=".*w1|.*w2", rank=4, alpha=2.0)
        inputs = tc.get_dummy_inputs_for_lora_toy_transformer_tests()
        actor = qwix.apply_lora_to_model(reference, provider, **inputs, rngs=nnx.Rngs(1))
    cluster = rl_cluster_lib.RLCluster(
        actor=actor,
        reference=reference,
        tokenizer=vocab,
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={
                rl_cluster_lib.Role.ACTOR: actor_mesh,
                rl_cluster_lib.Role.REFERENCE: actor_mesh,
                rl_cluster_lib.Role.ROLLOUT: rollout_mesh,
            },
            rollout_engine="vanilla",
            offload_to_cpu=False,
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=optax.sgd(1e-3), eval_every_n_steps=100, max_steps=args.steps
            ),
            rollout_config=base_rollout.RolloutConfig(max_tokens_to_generate=4, max_prompt_length=16, kv_cache_size=64),
        ),
    )
    loads = len(calls)
    learner = grpo_lib.GRPOLearner(
        rl_cluster=cluster,
        reward_fns=lambda completions, **_: jnp.arange(len(completions)),
        algo_config=grpo_lib.GRPOConfig(num_generations=2, num_iterations=1),
    )
    data = grain.MapDataset.source(PROMPTS * args.steps).batch(2).map(lambda x: {"prompts": x, "answer": x})
    learner.train(data, None)
    reshard.reshard_pytree = jreshard_tunix.reshard_pytree
    jreshard_tunix.uninstall()  # Tunix's own reshard_pytree is back

    print(f"GRPO, {'LoRA' if args.lora else 'full weights'}: actor FSDP4 on devices 0-3, rollout TP4 on devices 4-7")
    print(f"{'call':>4} {'what':>10} {'leaves':>6} {'jreshard ms':>12} {'device_put ms':>14} {'equal':>6}")
    for i, c in enumerate(calls):
        what = "load" if i < loads else "sync"
        print(
            f"{i:>4} {what:>10} {c['leaves']:>6} {c['jreshard_s'] * 1e3:>12.2f} {c['device_put_s'] * 1e3:>14.2f} "
            f"{'yes' if c['exact'] else 'NO':>6}"
        )
    syncs = calls[loads:]
    if syncs:
        jr = float(np.median([c["jreshard_s"] for c in syncs]))
        dp = float(np.median([c["device_put_s"] for c in syncs]))
        print(
            f"weight syncs: {len(syncs)}; median per sync: jreshard {jr * 1e3:.2f} ms, "
            f"jax.device_put {dp * 1e3:.2f} ms (device_put / jreshard = {dp / jr:.2f}, same run, one machine)"
        )
    ok = all(c["exact"] for c in calls)
    print("every call equal to jax.device_put's:", "yes" if ok else "NO")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
