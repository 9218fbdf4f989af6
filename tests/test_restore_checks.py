"""Restores whose description (draft.json, meta.json) disagrees with the config or the stored arrays are refused
naming the leaf, and token ids outside the vocabulary are refused naming the id (tiny configs only)."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import draft as D
from models import eagle as E
from models import layerskip as LS
from models.llama import LlamaConfig, init_random_params

pytestmark = pytest.mark.fast  # the fast tier: make test-fast

TARGET = LlamaConfig(
    vocab_size=48, hidden=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, ffn=64, name="tiny-target"
)
TARGET_PARAMS = init_random_params(TARGET, jax.random.key(0), std=0.1)
TOKEN_MAP = np.sort(np.random.default_rng(0).permutation(48)[:40]).astype(np.int32)


def _saved_draft(path, head_size=40):
    dcfg = D.draft_config(TARGET, 1, head_size=head_size)
    params = D.init_from_target(dcfg, TARGET_PARAMS, TOKEN_MAP if head_size else None)
    D.save_draft(path, dcfg, params)
    return dcfg, params


def _edit_json(path, edit):
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))


# ---- drafts (models/draft.py) -------------------------------------------------------------------------------


def test_draft_json_disagreeing_with_its_config_is_refused_naming_the_leaf(tmp_path):
    """restore_draft rebuilt its restore targets from draft.json's own leaf list and never compared it with the
    config: a draft.json saying 2 layers over 1-layer arrays loaded a draft whose config and params disagree, a
    leaf recorded as bfloat16 restored cast into a float32 draft, another head size failed far from the cause."""
    _, params = _saved_draft(tmp_path / "d")
    meta_path = tmp_path / "d" / D.META_FILE
    original = meta_path.read_text()
    wq = "['layers']['attn']['wq']"
    shape = re.escape(str(tuple(params["layers"]["attn"]["wq"].shape)))

    def more_layers(m):
        m["llama"]["num_layers"] = 2
        m["source_layers"] = [0, 1]

    def bf16_leaf(m):
        m["leaves"][wq][1] = "bfloat16"

    def bigger_head(m):
        m["head_size"] = 44

    def no_head_index(m):
        del m["leaves"]["['head']['index']"]

    cases = [
        (more_layers, r"\['layers'\]\[.*\] of \(1, .*; the draft's config implies \(2, "),
        (bf16_leaf, rf"has leaf {re.escape(wq)} of {shape} bfloat16; the draft's config implies {shape} float32"),
        (bigger_head, r"\['head'\]\[.*\] of \(40.*; the draft's config implies \(44"),
        (no_head_index, r"has no leaf \['head'\]\['index'\]; the draft's config implies \(48,\) int32"),
    ]
    for edit, message in cases:
        meta_path.write_text(original)
        _edit_json(meta_path, edit)
        with pytest.raises(ValueError, match=message):
            D.restore_draft(tmp_path / "d")
        with pytest.raises(ValueError, match=message):
            D.load_draft(tmp_path / "d", target_config=TARGET)
    # The same check before anything is written: params of another depth or dtype than the config says.
    dcfg2 = D.draft_config(TARGET, 2, head_size=40)
    deeper = r"save_draft .* \['layers'\]\[.*\] of \(1, .*; the draft's config implies \(2, "
    with pytest.raises(ValueError, match=deeper):
        D.save_draft(tmp_path / "e", dcfg2, params)
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    with pytest.raises(ValueError, match=r"save_draft .* bfloat16; the draft's config implies .* float32"):
        D.save_draft(tmp_path / "e", D.draft_config(TARGET, 1, head_size=40), bf16)
    assert not (tmp_path / "e").exists()
    meta_path.write_text(original)
    D.restore_draft(tmp_path / "d")  # the untouched file still loads


def test_draft_head_maps_are_checked_on_save_and_restore(tmp_path):
    """The head's ids / index were restored unchecked: repeated or out-of-range ids, or an index that is not
    their inverse, put q on other tokens than the draft samples (the decoder's losslessness assumes it does)."""
    import orbax.checkpoint as ocp

    dcfg, params = _saved_draft(tmp_path / "d")
    ids = np.asarray(params["head"]["ids"])
    index = np.asarray(params["head"]["index"])
    repeated = ids.copy()
    repeated[1] = repeated[0]
    outside = ids.copy()
    outside[-1] = 48
    absent = int(np.setdiff1d(np.arange(48), ids)[0])
    wrong_index = index.copy()
    wrong_index[absent] = 0  # an id outside the subset mapped to column 0
    cases = [
        ({"ids": repeated}, rf"head id {ids[0]} appears more than once"),
        ({"ids": outside}, r"head id 48 is outside the vocabulary \[0, 48\)"),
        ({"index": wrong_index}, rf"head index\[{absent}\] is 0, the head ids imply 40"),
    ]
    for change, message in cases:
        bad = {**params, "head": {**params["head"], **{k: jnp.asarray(v) for k, v in change.items()}}}
        with pytest.raises(ValueError, match=message):
            D.save_draft(tmp_path / "e", dcfg, bad)
        # Written past save_draft's check, as a corrupt or hand-made file would be.
        ckpt = ocp.StandardCheckpointer()
        ckpt.save((tmp_path / "d" / D.PARAMS_DIR).absolute(), bad, force=True)
        ckpt.wait_until_finished()
        with pytest.raises(ValueError, match=message):
            D.restore_draft(tmp_path / "d")


def test_token_ids_outside_the_vocabulary_are_named():
    """token_counts cut bincount's result to V, so ids >= V vanished from the counts; a negative id in
    frequent_token_map's ``always`` indexed from the end and kept another token."""
    np.testing.assert_array_equal(D.token_counts([[0, 2, 2], [3]], 4), [1, 0, 2, 1])
    with pytest.raises(ValueError, match=r"token id 7 is outside the vocabulary \[0, 4\)"):
        D.token_counts([[0, 1], [2, 7, 3]], 4)
    with pytest.raises(ValueError, match=r"token id -1 is outside the vocabulary \[0, 4\)"):
        D.token_counts([[0, -1]], 4)
    counts = np.asarray([5.0, 4.0, 3.0, 0.0])
    np.testing.assert_array_equal(D.frequent_token_map(counts, 2, always=[3]), [0, 3])
    for bad in (-1, 4):
        with pytest.raises(ValueError, match=rf"always: token id {bad} is outside the vocabulary \[0, 4\)"):
            D.frequent_token_map(counts, 2, always=[bad])


# ---- EAGLE heads and exit adapters (models/eagle.py, models/layerskip.py) ------------------------------------


def test_eagle_meta_json_disagreeing_with_the_arrays_is_refused_naming_the_leaf(tmp_path):
    """restore_head restored into the tree meta.json's config implies: a meta.json naming another depth, head
    size or fusion than the stored arrays failed with orbax's message, which names no leaf."""
    ecfg = E.EagleConfig(TARGET, head_tokens=20, name="tiny-eagle")
    hp = E.init_head(ecfg, TARGET_PARAMS, jax.random.key(1))
    E.save_head(tmp_path / "head", ecfg, hp)
    meta_path = tmp_path / "head" / "meta.json"
    original = meta_path.read_text()
    wq = tuple(hp["layers"]["attn"]["wq"].shape)

    def cfg(**changes):
        return lambda m: m["config"].update(changes)

    cases = [
        (cfg(layers=2), r"stored leaf \['layers'\]\[.*\] is \(1, .*, not compatible with the expected \(2, "),
        (cfg(head_tokens=24), r"stored leaf \['token_ids'\] is \(20,\) int32, not compatible with the expected \(24,"),
        (cfg(fuse=[0]), r"no stored leaf \['fuse'\]\['kernel'\] \(expected \(64, 32\) float32\)"),
    ]
    for edit, message in cases:
        meta_path.write_text(original)
        _edit_json(meta_path, edit)
        with pytest.raises(ValueError, match="EAGLE head '.*': " + message):
            E.restore_head(tmp_path / "head", TARGET)
    meta_path.write_text(original)
    _, restored = E.restore_head(tmp_path / "head", TARGET)
    assert restored["layers"]["attn"]["wq"].shape == wq


def test_exit_meta_json_disagreeing_with_the_arrays_is_refused_naming_the_leaf(tmp_path):
    """restore_exit_params(path, cfg) built its targets from meta.json's adapter_width / head_tokens; one that
    disagreed with the stored arrays failed inside orbax, naming no leaf."""
    ex = {
        "adapter": LS.init_adapter(TARGET, jax.random.key(2), 16),
        "token_ids": jnp.asarray(TOKEN_MAP[:20]),
    }
    LS.save_exit_params(tmp_path / "exit", ex, {"exit_layer": 1}, target_cfg=TARGET)
    meta_path = tmp_path / "exit" / "meta.json"
    original = meta_path.read_text()
    cases = [
        (
            {"adapter_width": 8},
            r"stored leaf \['adapter'\]\['w_down'\] is \(16, 32\) float32, not compatible with the "
            r"expected \(8, 32\) float32",
        ),
        ({"head_tokens": 0}, r"stored leaf \['token_ids'\] \(\(20,\) int32\) is not expected"),
        ({"adapter_width": 0}, r"stored leaf \['adapter'\]\['norm_scale'\] \(\(32,\) float32\) is not expected"),
    ]
    for change, message in cases:
        meta_path.write_text(original)
        _edit_json(meta_path, lambda m, change=change: m.update(change))
        with pytest.raises(ValueError, match="exit adapter '.*': " + message):
            LS.restore_exit_params(tmp_path / "exit", TARGET)
    meta_path.write_text(original)
    restored = LS.restore_exit_params(tmp_path / "exit", TARGET)
    np.testing.assert_array_equal(np.asarray(restored["token_ids"]), TOKEN_MAP[:20])
    # An integer leaf where the target wants a float one (or the other way round) is refused too.
    wrong = LS.abstract_exit_params(TARGET, 16, 20)
    wrong["token_ids"] = jax.ShapeDtypeStruct((20,), jnp.float32)
    with pytest.raises(
        ValueError,
        match=r"stored leaf \['token_ids'\] is \(20,\) int32, not compatible with the "
        r"expected \(20,\) float32",
    ):
        LS.restore_exit_params(tmp_path / "exit", target=wrong)
