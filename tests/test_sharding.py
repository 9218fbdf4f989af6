"""Sharding package, in-process on the suite's single CPU device: the table, mesh shapes, specs and their
fallbacks, HLO collective counting, the launcher. The multi-device checks run in subprocesses
(test_sharding_devices.py), so no fake devices leak into this process."""

from __future__ import annotations

import dataclasses
import sys
import types

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from jspec.cache import KV_AXES
from models.llama import LlamaConfig, param_logical_axes, param_shapes
from sharding import hlo
from sharding.launch import launch
from sharding.mesh import make_mesh, parse_shape, resolve_shape
from sharding.rules import PRESETS, TABLE, describe, fit_rules, rules, spec

pytestmark = pytest.mark.fast  # the fast tier: make test-fast


def _mesh(data: int, model: int):
    # spec/fit_rules only read axis sizes, so a stand-in works without 8 devices in this process.
    return types.SimpleNamespace(shape={"data": data, "model": model})


CFG = LlamaConfig(vocab_size=256, hidden=64, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=8, ffn=128)


def _names(tree) -> set[str]:
    out: set[str] = set()
    for axes in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, tuple)):
        out.update(a for a in axes if a is not None)
    return out


def _shapes(cfg):
    """Parameter ShapeDtypeStructs (no arrays allocated)."""
    is_shape = lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x)  # noqa: E731
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jax.numpy.float32), param_shapes(cfg), is_leaf=is_shape)


def test_table_covers_every_logical_axis_of_model_and_cache():
    # A logical name added to the model or cache without a table row would otherwise fail only at placement.
    names = _names(param_logical_axes(CFG)) | set(KV_AXES)
    assert names <= set(TABLE), names - set(TABLE)
    assert all(len(cols) == len(PRESETS) for cols in TABLE.values())


def test_presets():
    assert all(v is None for v in rules("replicated").as_dict().values())
    d, t, dt = rules("data"), rules("tensor"), rules("data_tensor")
    assert d["batch"] == "data" and d["heads"] is None and d["vocab"] is None
    assert t["batch"] is None and {t[k] for k in ("heads", "kv_heads", "mlp", "vocab")} == {"model"}
    assert dt["batch"] == "data" and dt["kv_heads"] == "model"
    for r in (d, t, dt):  # never split: contraction dims, the scanned layer axis, the cache sequence
        assert {r[k] for k in ("embed", "head_dim", "layers", "cache_seq")} == {None}
    assert rules("data_tensor", vocab=None)["vocab"] is None
    with pytest.raises(ValueError, match="unknown sharding preset"):
        rules("fsdp")
    with pytest.raises(KeyError, match="no entry in the sharding table"):
        rules("data")["experts"]


def test_resolve_and_parse_mesh_shapes():
    assert resolve_shape((2, -1), 8) == (2, 4)
    assert resolve_shape((-1, 8), 8) == (1, 8)
    assert resolve_shape((1, 1), 1) == (1, 1)
    for bad in [(-1, -1), (3, -1), (2, 2), (0, 8)]:
        with pytest.raises(ValueError):
            resolve_shape(bad, 8)
    assert parse_shape("2x4") == {"data": 2, "model": 4}
    assert parse_shape("data=2,model=-1") == {"data": 2, "model": -1}


def test_make_mesh_axis_types_are_auto():
    mesh = make_mesh({"model": -1})
    assert dict(mesh.shape) == {"data": 1, "model": 1}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_spec_splits_cache_over_batch_and_kv_heads_never_sequence():
    r = rules("data_tensor")
    assert spec(KV_AXES, (2, 8, 4, 48, 8), _mesh(2, 4), r) == P(None, "data", "model")
    notes: list[str] = []
    # 2 KV heads on a 4-way model axis: replicated over model, with a note saying why.
    assert spec(KV_AXES, (2, 8, 2, 48, 8), _mesh(2, 4), r, notes) == P(None, "data")
    assert notes and "kv_heads[2]" in notes[0]
    # A mesh axis is used once per array.
    assert spec(("heads", "mlp"), (8, 8), _mesh(1, 4), r) == P("model")
    assert spec(KV_AXES, (2, 8, 4, 48, 8), _mesh(1, 1), r) == P()


def test_fit_rules_query_heads_follow_kv_heads():
    axes, shapes = param_logical_axes(CFG), _shapes(CFG)
    r = rules("data_tensor")
    assert fit_rules(r, axes, shapes, _mesh(2, 4)) == r  # 8 heads, 4 KV heads: both split 4 ways
    f = fit_rules(r, axes, shapes, _mesh(1, 8))  # 4 KV heads cannot split 8 ways -> neither can query heads
    assert f["kv_heads"] is None and f["heads"] is None and f["mlp"] == "model" and f["vocab"] == "model"


def test_describe_lists_each_parameter():
    d = describe(param_logical_axes(CFG), _shapes(CFG), _mesh(2, 4), rules("tensor"))
    assert d["['layers']['attn']['wq']"] == "P(None, None, 'model')"
    assert d["['embed']['embedding']"] == "P('model')"
    assert d["['layers']['mlp']['w_down']"] == "P(None, 'model')"
    notes = describe(param_logical_axes(CFG), _shapes(CFG), _mesh(1, 8), rules("tensor"))
    assert "kv_heads[4] replicated over 'model'" in notes["['layers']['attn']['wk']"]


HLO = """HloModule m

%body.1 (p: (s32[], f32[2,4])) -> (s32[], f32[2,4]) {
  %ar = f32[2,4]{1,0} all-reduce(%x), channel_id=1, to_apply=%add
  ROOT %t = tuple()
}

%cond.1 (p: (s32[], f32[2,4])) -> pred[] {
  ROOT %c = pred[] compare()
}

%branch_a (p: f32[2]) -> f32[2] {
  %ag = f32[8,48,16]{2,1,0} all-gather(%y), channel_id=2, dimensions={0}
  %ag2 = f32[8,48,16]{2,1,0} all-gather(%y), channel_id=3, dimensions={0}
  ROOT %r = f32[2] copy(%p)
}

%branch_b (p: f32[2]) -> f32[2] {
  ROOT %r = f32[2] copy(%p)
}

%once_body (p: (s32[], f32[2])) -> (s32[], f32[2]) {
  %ar1 = f32[2]{0} all-reduce(%x), channel_id=7, to_apply=%add
  ROOT %t = tuple()
}

%once_cond (p: (s32[], f32[2])) -> pred[] {
  ROOT %c = pred[] compare()
}

%loop_body (p: (s32[], f32[2])) -> (s32[], f32[2]) {
  %w = (s32[], f32[2,4]) while(%init), condition=%cond.1, body=%body.1, backend_config={"known_trip_count":{"n":"3"}}
  %w1 = (s32[], f32[2]) while(%i1), condition=%once_cond, body=%once_body, metadata={op_name="f/at_most_once/while"}
  %cp = s32[4]{0} collective-permute(%z), channel_id=4, source_target_pairs={{0,1},{1,0}}
  %cnd = f32[2] conditional(%pr, %a, %b), branch_computations={%branch_a, %branch_b}
  ROOT %t = tuple()
}

%loop_cond (p: (s32[], f32[2])) -> pred[] {
  %any = pred[] all-reduce(%q), channel_id=5, to_apply=%or
  ROOT %c = pred[] copy(%any)
}

ENTRY %main (a: f32[2]) -> f32[2] {
  %pre = f32[2,4]{1,0} all-reduce(%a), channel_id=6, to_apply=%add
  %loop = (s32[], f32[2]) while(%i), condition=%loop_cond, body=%loop_body
  ROOT %o = f32[2] copy(%a)
}
"""


def test_hlo_analysis_counts_per_round():
    a = hlo.analyze(HLO)
    s = a.summary()
    assert s["decode_loops"] == 1  # the at-most-once loop inside the round is a branch, not a second loop
    assert s["outside_loop"] == {"all-reduce": 1}
    # per round: 3 scan iterations x 1 all-reduce + the at-most-once loop's all-reduce + permute + the larger
    # branch (2 all-gathers) + loop cond
    assert s["per_round"] == {"all-gather": 2, "all-reduce": 5, "collective-permute": 1}
    assert s["static_total"] == 7
    assert [c.op for c in hlo.cache_collectives(HLO, slots=48, head_dim=16)] == ["all-gather", "all-gather"]
    assert hlo.cache_collectives(HLO, slots=64, head_dim=16) == []


def test_launch_sets_env_and_stops_hung_processes():
    code = (
        "import os; print(os.environ['JSPEC_PROCESS_ID'], os.environ['JSPEC_NUM_PROCESSES'], "
        "os.environ['JSPEC_CPU_DEVICES'], os.environ['JSPEC_COORDINATOR'].startswith('127.0.0.1:'))"
    )
    codes, outs = launch([sys.executable, "-c", code], 2, 4, timeout=60, echo=False)
    assert codes == [0, 0]
    assert [o.split() for o in outs] == [["0", "2", "4", "True"], ["1", "2", "4", "True"]]
    # Process 1 fails at once, process 0 would hang: the launcher must stop it instead of waiting.
    hang = "import os, sys, time; sys.exit(3) if os.environ['JSPEC_PROCESS_ID'] == '1' else time.sleep(60)"
    codes, _ = launch([sys.executable, "-c", hang], 2, None, timeout=30, echo=False)
    assert codes[1] == 3 and codes[0] != 0


def test_global_batch_counts_rows_shared_by_processes_once():
    """process_local decoding: a process holding ``held`` of the data axis's ``d`` row blocks passed
    ``local`` rows of a batch of local * d / held. Cases: the batch split over 2 processes (data 2, one block
    each), 4 processes x 2 devices on a 2x4 mesh (the model axis spans 2 processes, which share a block: 4
    local rows of 8, not 16), and the batch not split (every process holds every row)."""
    from sharding.agreement import global_batch

    assert global_batch(4, held=1, data_size=2) == 8  # split (2 processes), or shared by processes 0 and 1
    assert global_batch(8, held=1, data_size=1) == 8
    assert global_batch(6, held=2, data_size=4) == 12
    with pytest.raises(ValueError, match="passed 3 rows but holds 2 of the 4 row blocks"):
        global_batch(3, held=2, data_size=4)
    with pytest.raises(ValueError, match="holds none of the data axis's row blocks"):  # was a ZeroDivisionError
        global_batch(4, held=0, data_size=2)


def test_cache_shardings_split_every_kv_shaped_leaf_of_a_cache(monkeypatch):
    """A compressed cache's block summaries (ck/cv, [L, B, Hkv, C, D]) and scratch pad (sk/sv) are split like
    its K/V (they were replicated on every device); lengths follow the batch; a [B, ...] leaf outside a cache
    too. The placement helpers are stubbed to name the rule each leaf got (no 8 devices in this process)."""
    from models.compressed import init_cache as compressed_cache
    from sharding import placement

    monkeypatch.setattr(placement, "named", lambda axes, shape, mesh, rules: ("kv", tuple(axes), tuple(shape)))
    monkeypatch.setattr(placement, "rows_sharding", lambda mesh, axis, shape, batch: ("rows", tuple(shape)))
    cache = compressed_cache(CFG, 4, batch=2, slots=16)
    got = placement.cache_shardings({"cache": cache, "seq": jnp.zeros((2, 17))}, None, rules("data_tensor"), 2)
    c = got["cache"]
    for name in ("k", "v", "sk", "sv"):
        assert getattr(c, name) == ("kv", KV_AXES, (2, 2, 4, 16, 8)), name
    for name in ("ck", "cv"):
        assert getattr(c, name) == ("kv", KV_AXES, (2, 2, 4, 5, 8)), name
    assert c.lengths == ("rows", (2,)) and got["seq"] == ("rows", (2, 17))


@dataclasses.dataclass(frozen=True)
class _HashableMesh:
    """A stand-in mesh that can key ``pinned_model``'s cache."""

    sizes: tuple[tuple[str, int], ...]

    @property
    def shape(self):
        return dict(self.sizes)


def test_draft_rules_are_fitted_to_the_draft_not_inherited_from_the_target():
    """The draft model was fitted starting from the target's already-fitted rules (or not fitted at all when
    draft_axes was not given), so it inherited the target's fallbacks, or split its query heads over KV heads
    it could not split. Now it is fitted from its own preset, and an unfitted plan that would split a draft
    model is refused when the decode is prepared."""
    from jspec.drafters import ModelDrafter
    from models.llama import make_model
    from sharding.sharded_decode import make_plan, pinned_drafter

    draft_cfg = CFG.replace(num_heads=8, num_kv_heads=8, name="draft")
    mesh = _HashableMesh((("data", 1), ("model", 8)))
    kw = dict(target_axes=param_logical_axes(CFG), target_shapes=_shapes(CFG))
    draft = dict(draft_axes=param_logical_axes(draft_cfg), draft_shapes=_shapes(draft_cfg))
    plan = make_plan(mesh, "data_tensor", **kw, **draft)
    assert plan.target["kv_heads"] is None and plan.target["heads"] is None  # 4 KV heads cannot split 8 ways
    assert plan.draft_rules["kv_heads"] == "model" and plan.draft_rules["heads"] == "model"  # 8 can

    small = CFG.replace(num_heads=4, num_kv_heads=2, name="small")  # 4 query / 2 KV heads on model=4
    mesh4 = _HashableMesh((("data", 2), ("model", 4)))
    plan = make_plan(mesh4, "data_tensor", **kw)  # no draft_axes: draft rules unfitted
    with pytest.raises(ValueError, match=r"never fitted to its shapes.*pass draft_axes= and draft_shapes="):
        pinned_drafter(ModelDrafter(make_model(small)), plan)
    fitted = make_plan(mesh4, "data_tensor", **kw, draft_axes=param_logical_axes(small), draft_shapes=_shapes(small))
    assert fitted.draft_rules["kv_heads"] is None and fitted.draft_rules["heads"] is None
    assert pinned_drafter(ModelDrafter(make_model(small)), fitted).model is not None
    # A replicated draft preset splits nothing but rows: nothing to fit.
    assert pinned_drafter(ModelDrafter(make_model(small)), make_plan(mesh4, "data_tensor", "data", **kw))


def test_fitting_needs_shapes_of_the_same_structure():
    """Axes without shapes, or shapes of another structure (e.g. another layout of the layers), made
    fit_rules pair names with no or the wrong sizes and return the rules unfitted, silently."""
    with pytest.raises(ValueError, match="logical axes were given without the parameter shapes"):
        fit_rules(rules("data_tensor"), param_logical_axes(CFG), None, _mesh(1, 8))
    partial = {k: v for k, v in _shapes(CFG).items() if k != "final_norm"}
    with pytest.raises(ValueError, match="do not have the structure of the logical axes"):
        fit_rules(rules("data_tensor"), param_logical_axes(CFG), partial, _mesh(1, 8))
    bad = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), _shapes(CFG))
    with pytest.raises(ValueError, match="do not match shape"):
        fit_rules(rules("data_tensor"), param_logical_axes(CFG), bad, _mesh(1, 8))


def test_plan_rules_must_name_mesh_axes():
    from sharding.sharded_decode import make_plan

    with pytest.raises(ValueError, match=r"map 'batch' to mesh axis 'data', which the mesh \(axes \('dp', 'tp'\)\)"):
        make_plan(_HashableMesh((("dp", 2), ("tp", 4))), "data_tensor")


@pytest.mark.parametrize(
    "text,match",
    [
        ("data=2,data=4", "axis 'data' is given twice"),
        ("data=2,,model=4", "'' is not name=size"),
        ("model:4", "'model:4' is not an axis size"),
        ("data=two", "'two' is not an axis size"),
    ],
)
def test_parse_shape_refuses_malformed_text(text, match):
    with pytest.raises(ValueError, match=match):
        parse_shape(text)


def _assert_gone(pid: int, what: str) -> None:
    """Wait up to 5 s for ``pid`` to disappear (the kernel reaps it once init collects the orphan)."""
    import os
    import time

    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(pid, 9)
    pytest.fail(f"{what} {pid} survived the launcher")


def test_launch_kills_the_processes_a_child_started(tmp_path):
    """Only the direct child was killed: a command wrapped in ``bash -c`` left its Python running, holding
    the coordinator port and the output pipe."""
    pidfile = tmp_path / "pid"
    script = f"{sys.executable} -c 'import time; time.sleep(120)' & echo $! > {pidfile}; wait"
    codes, _ = launch(["bash", "-c", script], 1, None, timeout=3, echo=False)
    assert codes == [-9]
    _assert_gone(int(pidfile.read_text()), "grandchild")


def test_launch_cleans_up_after_a_leader_that_already_exited(tmp_path):
    """A command whose shell exits at once (0) but leaves a Python process behind in its group: the launcher
    returns the shell's code and stops the group anyway (it used to kill only leaders still running)."""
    pidfile = tmp_path / "pid"
    script = f"{sys.executable} -c 'import time; time.sleep(120)' > /dev/null & echo $! > {pidfile}"
    codes, _ = launch(["bash", "-c", script], 1, None, timeout=30, echo=False)
    assert codes == [0]
    _assert_gone(int(pidfile.read_text()), "the process left by the command")


def test_restore_targets_recast_floats_only():
    """Restoring decode params in another dtype (bf16) must not recast token-id maps: 1025 in bf16 is 1024."""
    import jax.numpy as jnp

    from sharding.checkpoint import abstract

    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shapes = {"ids": jax.ShapeDtypeStruct((4,), jnp.int32), "w": jax.ShapeDtypeStruct((2, 3), jnp.float32)}
    got = abstract(shapes, {"ids": dev, "w": dev}, jnp.bfloat16)
    assert got["ids"].dtype == jnp.int32 and got["w"].dtype == jnp.bfloat16


def test_restore_refuses_non_float_dtypes():
    """An integer restore dtype would truncate the float weights silently (it recasts floating leaves)."""
    import jax.numpy as jnp

    from sharding.checkpoint import abstract, restore_decode_params, restore_params
    from sharding.mesh import single_device_mesh

    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with pytest.raises(ValueError, match="dtype=int8 is not a floating-point dtype"):
        abstract({"w": jax.ShapeDtypeStruct((2, 3), jnp.float32)}, {"w": dev}, jnp.int8)
    mesh = single_device_mesh()
    with pytest.raises(ValueError, match="dtype=int32 is not a floating-point dtype"):  # before reading the path
        restore_params("/nonexistent/ckpt", None, mesh, rules("replicated"), dtype="int32")
    with pytest.raises(ValueError, match="dtype=bool is not a floating-point dtype"):
        restore_decode_params("/nonexistent/ckpt", mesh, rules("replicated"), {}, dtype=bool)


def _stand_in_mesh(*process_indices: int):
    import numpy as np

    devices = [types.SimpleNamespace(process_index=i) for i in process_indices]
    return types.SimpleNamespace(devices=np.asarray(devices, dtype=object).reshape(1, -1))


def test_cross_process_checks_follow_the_mesh_not_the_process_count(monkeypatch):
    """With several processes running, a mesh of this process's devices only (``single_device_mesh``) is a
    local decode: no agreement collectives (one process decoding alone hung in a gather the others never
    joined). A mesh over every process runs them; one over some processes only is refused."""
    from sharding.agreement import spans_processes

    assert spans_processes(_stand_in_mesh(0)) is False  # one process
    monkeypatch.setattr(jax, "process_count", lambda: 3)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    assert spans_processes(_stand_in_mesh(1, 1)) is False
    assert spans_processes(_stand_in_mesh(0, 1, 2, 2)) is True
    with pytest.raises(ValueError, match=r"holds devices of process\(es\) \[0, 1\] of 3 \(this is process 1\)"):
        spans_processes(_stand_in_mesh(0, 1))
    with pytest.raises(ValueError, match=r"process\(es\) \[2\] of 3"):  # another process's devices only
        spans_processes(_stand_in_mesh(2))


def test_launch_refuses_fewer_than_one_process():
    """``-n 0`` ran nothing and exited 0."""
    from sharding.launch import main

    with pytest.raises(ValueError, match="num_processes must be an int >= 1, got 0"):
        launch([sys.executable, "-c", "pass"], 0, None, echo=False)
    with pytest.raises(SystemExit) as e:
        main(["-n", "-1", "--", sys.executable, "-c", "pass"])
    assert e.value.code == 2


def test_launch_stops_the_children_started_before_a_failing_start(monkeypatch, tmp_path):
    """A Popen that fails for the second process left the first one running (the start loop was outside the
    try/finally that stops the children)."""
    import subprocess

    real, started = subprocess.Popen, []

    def popen(*args, **kwargs):
        if started:
            raise OSError("no more processes")
        started.append(real(*args, **kwargs))
        return started[0]

    monkeypatch.setattr(subprocess, "Popen", popen)
    with pytest.raises(OSError, match="no more processes"):
        launch([sys.executable, "-c", "import time; time.sleep(120)"], 2, None, timeout=60, echo=False)
    _assert_gone(started[0].pid, "the first child")


def test_launch_reads_output_that_is_not_utf8():
    """A non-UTF-8 byte killed the reader thread (strict decoding): everything after it was lost."""
    code = "import sys; sys.stdout.buffer.write(b'bad \\xff byte\\n'); sys.stdout.flush(); print('after')"
    codes, outs = launch([sys.executable, "-c", code], 1, None, timeout=60, echo=False)
    assert codes == [0]
    assert outs[0] == "bad \ufffd byte\nafter\n"


def _toy_decode_setup(mesh=None):
    """A table model (vocab 4) with its parameters on a single-device plan (rows over a 1-way data axis)."""
    import numpy as np
    from toy_models import make_table_model

    from sharding.mesh import single_device_mesh
    from sharding.placement import shard_params
    from sharding.sharded_decode import make_plan

    model, tab = make_table_model(np.random.default_rng(0).normal(size=(4, 4, 3, 4)))
    plan = make_plan(mesh or single_device_mesh(), "data")
    return model, shard_params(tab, None, plan.mesh, plan.target), plan


@pytest.mark.parametrize("cross", [False, True])
def test_prepare_sharded_refuses_debug_checks(monkeypatch, cross):
    """debug_checks=True passed prepare_sharded, and every sharded decode then failed inside JAX ("Cannot
    abstractly evaluate a checkify.check which was not functionalized"): the sharded program is not
    checkified. Refused by name, also on the multi-process path (after its gathers, so no process hangs)."""
    from sharding import sharded_decode
    from sharding.sharded_decode import prepare_sharded

    model, tp, plan = _toy_decode_setup()
    if cross:  # the agreement collectives run (over this one process)
        monkeypatch.setattr(sharded_decode, "spans_processes", lambda mesh: True)
    with pytest.raises(ValueError, match=r"debug_checks=True is not supported by a sharded decode"):
        prepare_sharded(model, tp, [[1, 2]], plan=plan, max_new_tokens=4, debug_checks=True)
    assert prepare_sharded(model, tp, [[1, 2]], plan=plan, max_new_tokens=4, debug_checks=False).global_batch == 1


@pytest.mark.parametrize("budget", [2**40, 2**64, [3, 2**40]])
def test_process_local_cache_size_refuses_sizes_past_int32(monkeypatch, budget):
    """process_local=True without max_len gathers the cache size the rows need. A budget past int32 raised an
    OverflowError (packing it for the gather, or 2**64 in int64) outside the error handling, in that process
    only: the others waited in the gather for good. Now a ValueError that names the size, raised after the
    gather."""
    from sharding import sharded_decode
    from sharding.agreement import MAX_SLOTS, cache_need
    from sharding.sharded_decode import prepare_sharded

    model, tp, plan = _toy_decode_setup()
    monkeypatch.setattr(sharded_decode, "spans_processes", lambda mesh: True)
    prompts = [[1, 2]] if isinstance(budget, int) else [[1, 2], [3]]
    need = max(len(p) + b - 1 for p, b in zip(prompts, budget if isinstance(budget, list) else [budget]))
    with pytest.raises(ValueError, match=rf"need a KV cache of {need} slots .* more than {MAX_SLOTS}"):
        prepare_sharded(model, tp, prompts, plan=plan, process_local=True, max_new_tokens=budget)
    assert cache_need(model, None, [[1, 2], [3]], [5, 7]) == 7  # P + N - 1
    assert cache_need(model, None, [[1, 2]], MAX_SLOTS - 1) == MAX_SLOTS
    with pytest.raises(ValueError, match="needs max_len"):
        cache_need(model, None, [[1, 2]], None)


def test_plan_refuses_explicit_mesh_axes():
    """jax.make_mesh defaults to Explicit axes in this JAX; the model code carries no sharding annotations, so a
    plan on such a mesh failed deep in tracing. Refused where the plan (or our make_mesh) is made."""
    from sharding.sharded_decode import make_plan

    explicit = (jax.sharding.AxisType.Explicit,) * 2
    mesh = jax.make_mesh((1, 1), ("data", "model"), axis_types=explicit, devices=jax.devices()[:1])
    with pytest.raises(ValueError, match=r"needs every axis Auto.*sharding\.mesh\.make_mesh"):
        make_plan(mesh, "data_tensor")
    with pytest.raises(ValueError, match=r"needs Auto mesh axes"):
        make_mesh((1, 1), devices=jax.devices()[:1], axis_types=jax.sharding.AxisType.Explicit)
    auto = (jax.sharding.AxisType.Auto,) * 2
    assert make_plan(jax.make_mesh((1, 1), ("data", "model"), axis_types=auto, devices=jax.devices()[:1]))
    assert make_plan(make_mesh((1, 1), devices=jax.devices()[:1]))


def test_static_digest_depends_on_the_kind_of_seed_not_the_local_rows():
    """The settings digest held key.shape: per-row keys are [local rows], which differ between processes
    holding different numbers of rows (refused as "different decode settings"). It holds the key's ndim now."""
    import jax.numpy as jnp

    from jspec.decode import prepare
    from sharding.agreement import static_digest

    model, tab, _ = _toy_decode_setup()
    config = prepare(model, tab, [[1, 2]], max_new_tokens=4, max_len=128).config
    keys = lambda n: jnp.stack([jax.random.key(i) for i in range(n)])  # noqa: E731
    assert static_digest(config, None, model, keys(2)) == static_digest(config, None, model, keys(3))
    assert static_digest(config, None, model, keys(2)) != static_digest(config, None, model, jax.random.key(0))


def test_fit_rules_query_heads_follow_kv_heads_the_rules_leave_whole():
    """Query heads followed the KV heads only when fitting switched the KV heads off for divisibility, not when
    the rules themselves left them whole (mapped to None, or to a mesh axis of size 1)."""
    axes, shapes = param_logical_axes(CFG), _shapes(CFG)
    f = fit_rules(rules("data_tensor", kv_heads=None), axes, shapes, _mesh(2, 4))
    assert f["kv_heads"] is None and f["heads"] is None and f["mlp"] == "model"
    f = fit_rules(rules("data_tensor", kv_heads="data"), axes, shapes, _mesh(1, 4))  # a 1-way axis: whole
    assert f["heads"] is None and f["mlp"] == "model"
    r = rules("data_tensor")  # a data-only mesh: nothing splits heads, the preset stays as it is
    assert fit_rules(r, axes, shapes, _mesh(8, 1)) == r
    assert fit_rules(rules("data_tensor", kv_heads="data"), axes, shapes, _mesh(4, 4))["heads"] == "model"


def test_describe_refuses_shapes_of_another_structure():
    """describe flattened axes and shapes separately and zipped them: a missing or extra parameter paired the
    names with the wrong arrays silently."""
    partial = {k: v for k, v in _shapes(CFG).items() if k != "final_norm"}
    with pytest.raises(ValueError, match="do not have the structure of the logical axes"):
        describe(param_logical_axes(CFG), partial, _mesh(2, 4), rules("tensor"))


def test_state_shardings_replicate_per_position_stats_when_k_equals_the_batch():
    """Any state leaf whose leading dimension equalled B was split over the data axis, so with K == B the
    per-position statistics ([K]) were split as if they were rows. On an abstract 4x1 mesh (no devices)."""
    import functools

    from jspec.decode import prepare
    from jspec.drafters import ModelDrafter
    from jspec.loop import prefill
    from sharding.sharded_decode import DecodePlan, state_shardings

    model, tab, _ = _toy_decode_setup()
    pd = prepare(model, tab, [[1, 2]] * 4, drafter=ModelDrafter(model), draft_params=tab, gamma=4, max_new_tokens=4)
    st = jax.eval_shape(functools.partial(prefill, model, ModelDrafter(model), pd.config), *pd.args)
    assert st.seq.shape[0] == 4 and st.stats.accepted_at.shape == (4,)  # K == B
    auto = (jax.sharding.AxisType.Auto,) * 2
    plan = DecodePlan(jax.sharding.AbstractMesh((4, 1), ("data", "model"), axis_types=auto), rules("data"))
    sh = state_shardings(st, plan)
    assert sh.stats.accepted_at.spec == P() and sh.stats.proposed_at.spec == P()
    assert sh.stats.accepted.spec == P("data") and sh.stats.rounds.spec == P("data")
    assert sh.seq.spec == P("data") and sh.stop.spec == P("data") and sh.cache.k.spec == P(None, "data")
