"""Orbax save/restore of params is verified: a digest per array written at save and
checked at restore, and a clear error naming the array for a damaged checkpoint or a
`like` model of another structure, shape or dtype."""

import logging
import os

import jax
import numpy as np
import pytest
from conftest import bits, fixture_path

import jspec

DIGEST_FILE = "jspec_digests.json"  # jspec.checkpoint.DIGEST_FILE, spelled out: its name
# inside a checkpoint directory is a format others may read.


def _model(name="qwen3", dtype="bfloat16"):
    return jspec.load_hf(fixture_path(name), dtype=dtype, backend="xla")


@pytest.fixture
def saved(tmp_path):
    model = _model()
    path = str(tmp_path / "ckpt")
    jspec.save_params(path, model)
    return path, model


def _equal(a, b):
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        np.testing.assert_array_equal(bits(x), bits(y))


def test_round_trip_is_verified(saved):
    path, model = saved
    assert os.path.exists(os.path.join(path, DIGEST_FILE))
    _equal(jspec.restore_params(path, model), model)


def test_a_saved_checkpoint_is_never_replaced(saved):
    # save_params writes a new directory; a head saved into one would mix two formats.
    path, model = saved
    with pytest.raises(FileExistsError, match="exists: save_params writes a new checkpoint"):
        jspec.save_params(path, model)
    with pytest.raises(FileExistsError, match="holds a jspec params checkpoint"):
        jspec.save_eagle3(path, None)  # refused before the head is read
    _equal(jspec.restore_params(path, model), model)


def test_nothing_beside_or_around_a_path_is_lost(saved, tmp_path):
    # orbax writes into path + ".orbax-checkpoint-tmp" and removed whatever held that name
    # (a finished checkpoint, a file); a dangling link passed os.path.exists and failed in
    # orbax's threads after the whole save; a save inside a checkpoint added to it.
    path, model = saved
    # A name orbax takes for an unfinished save is refused: it would not restore.
    with pytest.raises(ValueError, match="orbax-checkpoint-tmp: a name orbax keeps for"):
        jspec.save_params(str(tmp_path / "run.orbax-checkpoint-tmp"), model)
    os.mkdir(tmp_path / "run.orbax-checkpoint-tmp")
    (tmp_path / "run.orbax-checkpoint-tmp" / "data").write_text("kept")
    (tmp_path / "x.orbax-checkpoint-tmp").write_text("notes")
    for where in ("run", "x"):
        with pytest.raises(FileExistsError, match=r"orbax-checkpoint-tmp exists: save_params"):
            jspec.save_params(str(tmp_path / where), model)
    assert (tmp_path / "run.orbax-checkpoint-tmp" / "data").read_text() == "kept"
    assert (tmp_path / "x.orbax-checkpoint-tmp").read_text() == "notes"
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    with pytest.raises(FileExistsError, match="dangling exists"):
        jspec.save_params(str(tmp_path / "dangling"), model)
    with pytest.raises(FileExistsError, match=r"is inside the checkpoint .*ckpt"):
        jspec.save_params(os.path.join(path, "inner"), model)
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "dangling", "run.orbax-checkpoint-tmp",
                                            "x.orbax-checkpoint-tmp"]


def test_a_path_that_cannot_be_created_is_refused_before_orbax(tmp_path):
    # Orbax fails such a path in background threads that then keep the process alive for
    # minutes; save_params names the problem first, and leaves nothing behind.
    model = _model()
    (tmp_path / "afile").write_text("")
    with pytest.raises(jspec.CheckpointError, match="afile is a file, not a directory"):
        jspec.save_params(str(tmp_path / "afile" / "sub" / "ckpt"), model)
    if os.path.isdir("/proc/self"):  # a directory no one (root included) can write into
        with pytest.raises(jspec.CheckpointError, match="cannot create the checkpoint"):
            jspec.save_params("/proc/jspec_ckpt", model)
    jspec.save_params(str(tmp_path / "new" / "deeper" / "ckpt"), model)  # parents made


def test_a_path_under_home_is_expanded(tmp_path, monkeypatch):
    # "~/ckpt" is the home directory's, as in a shell (not a folder named "~" here).
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    model = _model()
    jspec.save_params("~/ckpt", model)
    assert os.path.exists(tmp_path / "home" / "ckpt" / DIGEST_FILE)
    assert not os.path.exists(tmp_path / "~")
    _equal(jspec.restore_params("~/ckpt", model), model)


def test_corrupted_data_file_names_the_array(saved):
    """64 bytes overwritten in the middle of the largest data file: orbax restores it
    without complaint (changed values, some NaN) and the digests catch it, or, where the
    bytes land on a compressed chunk's header (the store's layout varies by run), the
    chunk fails to decode; either error names the array."""
    path, model = saved
    files = [os.path.join(root, f) for root, _, fs in os.walk(path) for f in fs]
    largest = max(files, key=os.path.getsize)
    with open(largest, "r+b") as f:
        f.seek(os.path.getsize(largest) // 2)
        f.write(b"\xff" * 64)
    with pytest.raises(jspec.CheckpointError,
                       match=r"array '[\w.]+' (differs from the digest written at save"
                             r"|could not be read)"):
        jspec.restore_params(path, model)


def test_a_damaged_digest_entry_is_a_checkpoint_error(saved):
    import json

    path, model = saved
    fn = os.path.join(path, DIGEST_FILE)
    record = json.load(open(fn))
    record["arrays"][next(iter(record["arrays"]))] = "xx"
    json.dump(record, open(fn, "w"))
    with pytest.raises(jspec.CheckpointError, match=r"not a jspec digest file \(array '.*' "
                                                   r"has no sha256 entry\)"):
        jspec.restore_params(path, model)


def test_like_of_another_dtype_shape_or_structure(saved):
    path, model = saved
    with pytest.raises(jspec.CheckpointError, match="array 'embed' is bfloat16 in the "
                                                    "checkpoint but float32 in `like`"):
        jspec.restore_params(path, _model(dtype="float32"))
    with pytest.raises(jspec.CheckpointError, match="array 'layers.2.attn_norm' of `like` is "
                                                    "not in the checkpoint"):
        jspec.restore_params(path, _model("llama3"))
    params = jax.tree.map(lambda x: x, model.params)
    params["layers"][1]["wo"] = params["layers"][1]["wo"][:-1]
    with pytest.raises(jspec.CheckpointError, match=r"array 'layers.1.wo' has shape \(128, 64\)"
                                                    r" in the checkpoint but \(127, 64\)"):
        jspec.restore_params(path, model.replace(params=params))


def test_checkpoint_without_digests_restores_with_a_warning(saved, caplog):
    path, model = saved
    os.remove(os.path.join(path, DIGEST_FILE))
    caplog.set_level(logging.WARNING, logger="jspec")
    _equal(jspec.restore_params(path, model), model)
    assert any("cannot be verified" in r.getMessage() for r in caplog.records)


def test_a_hugging_face_folder_is_pointed_to_load_hf(saved):
    # orbax's answer was "could not read the checkpoint's metadata (AttributeError ...)".
    _, model = saved
    with pytest.raises(jspec.CheckpointError, match="a Hugging Face checkpoint.*load_hf"):
        jspec.restore_params(fixture_path("qwen3"), model)


def test_a_directory_without_orbax_metadata_is_named_not_an_attribute_error(saved, tmp_path):
    """An empty directory, or a checkpoint whose orbax metadata files are gone, was
    "orbax could not read the checkpoint's metadata (AttributeError: 'NoneType' object
    has no attribute 'tree')"."""
    path, model = saved
    (tmp_path / "empty").mkdir()
    with pytest.raises(jspec.CheckpointError, match="not a params checkpoint of save_params, "
                                                    "or a damaged one: it is an empty"):
        jspec.restore_params(str(tmp_path / "empty"), model)
    for name in ("_METADATA", "_CHECKPOINT_METADATA"):
        os.remove(os.path.join(path, name))
    with pytest.raises(jspec.CheckpointError, match="orbax finds no metadata in it"):
        jspec.restore_params(path, model)


@pytest.mark.parametrize("edit, match", [
    (lambda r: r["arrays"].pop("embed"),
     f"{DIGEST_FILE} has no digest of array 'embed' \\(1 unlisted\\)"),
    (lambda r: r.update(tensor_parallel="1"),
     r"not a jspec digest file \(tensor_parallel='1' is not a degree"),
])
def test_a_digest_file_that_lists_too_little_is_named_as_such(saved, edit, match):
    """An array missing from the digest file was reported as differing from its digest
    (a corrupt data file), and a tensor_parallel of "1" as a checkpoint "tensor-parallel
    over 1 devices"."""
    import json

    path, model = saved
    fn = os.path.join(path, DIGEST_FILE)
    record = json.load(open(fn))
    edit(record)
    json.dump(record, open(fn, "w"))
    with pytest.raises(jspec.CheckpointError, match=match):
        jspec.restore_params(path, model)


def test_a_name_the_file_system_refuses_is_refused_before_orbax(tmp_path):
    # A name within the limit that orbax's ".orbax-checkpoint-tmp" pushes past it, or a NUL:
    # orbax's threads would fail and then keep the process from exiting.
    model = _model()
    with pytest.raises(jspec.CheckpointError, match="cannot create the checkpoint"):
        jspec.save_params(str(tmp_path / ("y" * 240)), model)
    with pytest.raises(ValueError, match="NUL character"):
        jspec.save_params(str(tmp_path / "a\0b"), model)
    assert os.listdir(tmp_path) == []


def test_a_fused_draft_layout_saves_and_restores_as_the_plain_one(tmp_path):
    # DraftOptions.fused keeps the layer weights transposed; a checkpoint holds [in, out]
    # whatever the model's options, and restores into either layout.
    plain = jspec.with_options(_model(), backend="xla")
    fused = jspec.with_options(plain, jspec.DraftOptions(fused=True))
    jspec.save_params(str(tmp_path / "f"), fused)
    jspec.save_params(str(tmp_path / "p"), plain)
    for path in ("f", "p"):
        _equal(jspec.restore_params(str(tmp_path / path), plain), plain)
        _equal(jspec.restore_params(str(tmp_path / path), fused), fused)
    # One written in the transposed layout (as save_params once wrote a fused model's).
    import json

    import orbax.checkpoint as ocp

    from jspec.checkpoint import DIGEST_FORMAT, param_digests
    old = str(tmp_path / "t")
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(old, fused.params)
        ckptr.wait_until_finished()
    with open(os.path.join(old, DIGEST_FILE), "w") as f:
        json.dump({"format": DIGEST_FORMAT, "algorithm": "sha256", "tensor_parallel": 1,
                   "arrays": param_digests(fused.params)}, f)
    _equal(jspec.restore_params(old, plain), plain)
    _equal(jspec.restore_params(old, fused), fused)
