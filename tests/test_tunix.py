"""Tunix's real classes, resharding through jreshard.integrations.tunix.install(): an RLCluster whose actor and
rollout live on different meshes (full weights and LoRA) through sync_weights, GRPO training steps with Tunix's
toy transformer, and generate.utils.transfer_state_with_mappings with key mappings and transposes. Every call
Tunix makes to its resharding entry point is checked against jax.device_put on the same source and shardings.

Tunix is the optional extra ``jreshard[tunix]`` (installed by ``make test``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _device_put_oracle import assert_same_as_device_put
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jreshard
from jreshard.integrations import tunix as jt

pytest.importorskip("tunix", reason="Tunix is the optional extra jreshard[tunix]")
import grain
import optax
import qwix
from flax import nnx
from tunix.generate import utils as generate_utils
from tunix.rl import reshard
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner as grpo_lib
from tunix.rl.rollout import base_rollout
from tunix.tests import test_common as tc

# Tunix 0.1.7 and qwix call many APIs that flax 0.12 and jax 0.10 deprecate (Variable.value, State.flat_state,
# `with mesh`, VariableState, Module.iter_modules...): their DeprecationWarnings, not jreshard's (every other test
# module runs the same jreshard code with warnings as errors).
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

DEVS = sorted(jax.devices(), key=lambda d: d.id)
ACTOR = Mesh(np.array(DEVS[:4]).reshape(4, 1), ("fsdp", "tp"))
ROLLOUT = Mesh(np.array(DEVS[4:]).reshape(1, 4), ("fsdp", "tp"))


def _shardings_of(target):
    """The shardings Tunix's own reshard_pytree hands to jax.device_put for ``target``."""
    return jax.tree_util.tree_map(
        lambda t: t if isinstance(t, jax.sharding.Sharding) else t.sharding,
        target,
        is_leaf=lambda v: isinstance(v, (jax.Array, jax.ShapeDtypeStruct)),
    )


@pytest.fixture
def checked_calls():
    """install(), then every call Tunix makes to its entry point goes to jreshard's reshard_pytree and its
    result is compared with jax.device_put's (outside Tunix's transfer guards: the oracle reads shards)."""
    assert not jt.installed()
    jt.install()
    assert reshard.reshard_pytree is jt.reshard_pytree
    calls: list[int] = []

    def checked(source, target, *args, **kwargs):
        with jax.transfer_guard("allow"):
            want = jax.device_put(source, _shardings_of(target))
        out = jt.reshard_pytree(source, target, *args, **kwargs)
        with jax.transfer_guard("allow"):
            assert_same_as_device_put(out, want)
        calls.append(len(jax.tree_util.tree_leaves(out)))
        return out

    reshard.reshard_pytree = checked
    try:
        yield calls
    finally:
        reshard.reshard_pytree = jt.reshard_pytree
        assert jt.uninstall()


def test_install_replaces_only_tunixs_entry_point_and_uninstall_puts_it_back():
    original, device_put = reshard.reshard_pytree, jax.device_put
    assert not jt.installed()
    jt.install()
    jt.install()  # a second install does nothing
    try:
        assert reshard.reshard_pytree is jt.reshard_pytree and jt.installed()
        assert jax.device_put is device_put
    finally:
        assert jt.uninstall()
    assert reshard.reshard_pytree is original and not jt.installed()
    assert not jt.uninstall()


def test_reshard_fn_keyword_calls_flags_and_donation():
    src = NamedSharding(ACTOR, P("fsdp", "tp"))
    dst = NamedSharding(ROLLOUT, P("fsdp", "tp"))
    source = {
        "layer": {"w": jax.device_put(jnp.arange(64.0).reshape(8, 8), src)},
        "host": np.arange(8, dtype=np.float32).reshape(2, 4),
        "kept": jax.device_put(jnp.ones((4, 4)), dst),
    }
    target = {
        "layer": {"w": jax.device_put(jnp.zeros((8, 8), jnp.bfloat16), dst)},  # an array: its sharding, no cast
        "host": jax.ShapeDtypeStruct((2, 4), jnp.float32, sharding=dst),
        "kept": dst,
    }
    want = jax.device_put(source, _shardings_of(target))
    out = jt.reshard_pytree(source=source, target=target, cache_plan=False, use_experimental_pre_reshard=False)
    assert_same_as_device_put(out, want)
    assert out["layer"]["w"].dtype == jnp.float32  # Tunix's targets give shardings: nothing is cast
    donated = jt.reshard_pytree(source, target, donate_input=True)
    assert_same_as_device_put(donated, want)
    assert source["layer"]["w"].is_deleted()  # its bytes moved
    assert donated["kept"] is source["kept"] and not source["kept"].is_deleted()  # returned as it is
    with pytest.raises(TypeError, match=r"donate_input must be a bool, got str 'yes'"):
        jt.reshard_pytree(want, target, donate_input="yes")
    with pytest.raises(jreshard.LayoutMismatchError, match="structure"):
        jt.reshard_pytree(want, {"layer": target["layer"]})


def test_transfer_state_with_mappings_key_mappings_and_transposes(checked_calls):
    fsdp, tp = NamedSharding(ACTOR, P("fsdp", None)), NamedSharding(ROLLOUT, P(None, "tp"))
    kernels = [jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16) * (i + 1) / 7 for i in range(2)]
    embed = jnp.arange(16 * 8, dtype=jnp.float32).reshape(16, 8) / 3

    def trainer_state():
        layers = {i: {"kernel": nnx.Param(jax.device_put(k, fsdp))} for i, k in enumerate(kernels)}
        return nnx.State({"encoder": {"layers": layers}, "embed": nnx.Param(jax.device_put(embed, fsdp))})

    def rollout_state():  # other names, transposed kernels, bfloat16, another mesh
        layers = {i: {"w": nnx.Param(jax.device_put(jnp.zeros((16, 8), jnp.bfloat16), tp))} for i in range(2)}
        return nnx.State({"model": {"layers": layers}, "tok": nnx.Param(jax.device_put(jnp.zeros((16, 8)), tp))})

    mappings = {"encoder.layers.*.kernel": ("model.layers.*.w", None), "embed": ("tok", None)}
    for chunk in (None, 1):  # one call reshard_fn(tree, shardings); chunks of reshard_fn(source=..., target=...)
        before = len(checked_calls)
        new = generate_utils.transfer_state_with_mappings(
            trainer_state(),
            rollout_state(),
            key_mappings=mappings,
            transpose_keys={"kernel": (1, 0)},
            reshard_fn=reshard.reshard_pytree,
            reshard_chunk_size=chunk,
        )
        assert len(checked_calls) - before == (1 if chunk is None else 3)
        for i, k in enumerate(kernels):
            w = new["model"]["layers"][i]["w"][...]
            assert_same_as_device_put(w, jax.device_put(k.T.astype(jnp.bfloat16), tp))
        assert_same_as_device_put(new["tok"][...], jax.device_put(embed, tp))


def _cluster(actor, reference, **rollout):
    config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={
            rl_cluster_lib.Role.ACTOR: ACTOR,
            rl_cluster_lib.Role.REFERENCE: ACTOR,
            rl_cluster_lib.Role.ROLLOUT: ROLLOUT,
        },
        rollout_engine="vanilla",
        offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optax.sgd(1e-3), eval_every_n_steps=10, max_steps=10
        ),
        rollout_config=base_rollout.RolloutConfig(
            max_tokens_to_generate=4, max_prompt_length=16, kv_cache_size=64, **rollout
        ),
    )
    return rl_cluster_lib.RLCluster(actor=actor, reference=reference, tokenizer=tc.MockVocab(), cluster_config=config)


def _toy(seed=0):
    return tc.ToyTransformer(config=tc.ModelConfig(vocab_size=tc.MockVocab().GetPieceSize()), rngs=nnx.Rngs(seed))


def _lora(model):
    provider = qwix.LoraProvider(module_path=".*w1|.*w2", rank=4, alpha=2.0)
    lora = qwix.apply_lora_to_model(
        model, provider, **tc.get_dummy_inputs_for_lora_toy_transformer_tests(), rngs=nnx.Rngs(1)
    )
    return reshard.reshard_model_to_mesh(lora, ACTOR)  # Tunix's own helper: through the installed entry point


def _params(model, which=nnx.Param):
    return nnx.state(model, which)


def _assert_rollout_holds_actor_weights(cluster, which):
    actor, rollout = _params(cluster.actor_trainer.model, which), _params(cluster.rollout.model(), which)
    with jax.transfer_guard("allow"):
        for a, r in zip(jax.tree.leaves(actor), jax.tree.leaves(rollout), strict=True):
            assert r.sharding.mesh == ROLLOUT and a.sharding.mesh == ACTOR
            np.testing.assert_array_equal(np.asarray(r), np.asarray(a))


def test_rl_cluster_sync_weights_full_weights_across_meshes(checked_calls):
    cluster = _cluster(_toy(0), _toy(0))
    assert len(checked_calls) >= 2  # the actor and the rollout model loaded onto their meshes
    actor = cluster.actor_trainer.model
    nnx.update(actor, jax.tree.map(lambda v: v * 1.5 + 0.25, _params(actor)))  # a "training step"
    before = len(checked_calls)
    cluster.sync_weights()  # under Tunix's disallow_explicit host<->device guards on CPU
    assert len(checked_calls) == before + 1 and checked_calls[-1] == len(jax.tree.leaves(_params(actor)))
    _assert_rollout_holds_actor_weights(cluster, nnx.Param)


def test_grpo_training_steps_with_lora_across_meshes(checked_calls):
    reference = _toy(0)
    actor = _lora(reference)
    lora_before = jax.tree.map(jnp.copy, _params(actor, nnx.LoRAParam))
    cluster = _cluster(actor, reference)
    learner = grpo_lib.GRPOLearner(
        rl_cluster=cluster,
        reward_fns=lambda completions, **_: jnp.arange(len(completions)),
        algo_config=grpo_lib.GRPOConfig(num_generations=2, num_iterations=1),
    )
    prompts = ["input string", "hello world", "My name", "hello there"]
    data = grain.MapDataset.source(prompts).batch(2).map(lambda x: {"prompts": x, "answer": x})
    before = len(checked_calls)
    learner.train(data, None)
    assert len(checked_calls) - before >= 2  # a weight sync per training step
    lora_after = _params(cluster.actor_trainer.model, nnx.LoRAParam)
    with jax.transfer_guard("allow"):
        pairs = zip(jax.tree.leaves(lora_before), jax.tree.leaves(lora_after), strict=True)
        assert any(not np.array_equal(a, b) for a, b in pairs)  # training moved the LoRA weights
    _assert_rollout_holds_actor_weights(cluster, nnx.LoRAParam)
