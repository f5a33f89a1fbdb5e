"""Checkpoints that do not lie: checksums verified at load, a damaged `latest` or manifest named with
the fix, and a failed save (a real EFBIG) that leaves no staging folder behind."""

from __future__ import annotations

import zlib
import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from dist import run_ranks
from test_checkpoint import ds_config, single_engine, train

TAG1, TAG2 = "global_step1", "global_step2"


@pytest.fixture
def saved(tmp_path) -> Path:
    """A save dir with two complete tags, global_step1 and global_step2 (`latest`)."""
    engine, loader = single_engine()
    for step in (1, 2):
        train(engine, loader, step)
        engine.save_checkpoint(tmp_path, client_state={"step": step})
    return tmp_path


def load(folder: Path, **kwargs):
    engine, _ = single_engine()
    return engine.load_checkpoint(folder, **kwargs), engine


def manifest_of(tag_folder: Path) -> dict:
    return json.loads((tag_folder / "crew_checkpoint.json").read_text())


def flip(path: Path, count: int = 64) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + count] = bytes(b ^ 0xFF for b in data[middle:middle + count])
    path.write_bytes(bytes(data))


def test_the_manifest_lists_every_file_with_its_size_and_crc32(saved):
    tag = saved / TAG2
    files = manifest_of(tag)["files"]
    on_disk = {p.name for p in tag.iterdir()} - {"crew_checkpoint.json"}
    assert set(files) == on_disk == {"crew_state.pt", "mp_rank_00_model_states.pt", "rank0.pt"}
    for name, entry in files.items():
        data = (tag / name).read_bytes()
        assert entry == {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}, name


def test_write_atomic_hashes_large_writes_on_the_side_and_small_ones_inline(tmp_path):
    from crew.runtime.checkpoint.layout import write_atomic

    state = {"big": torch.arange(1 << 20, dtype=torch.float32), "small": torch.ones(3)}  # 4 MB + 12 B
    entry = write_atomic(tmp_path / "state.pt", obj=state)
    data = (tmp_path / "state.pt").read_bytes()
    assert entry == {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    assert torch.equal(torch.load(tmp_path / "state.pt", weights_only=True)["big"], state["big"])


@pytest.mark.parametrize("name", ["mp_rank_00_model_states.pt", "crew_state.pt", "rank0.pt"])
def test_flipped_bytes_in_any_file_the_load_reads_are_named_with_the_fix(saved, name):
    flip(saved / TAG2 / name)
    with pytest.raises(Exception) as raised:
        load(saved)
    message = str(raised.value)
    assert f"{saved / TAG2 / name} is damaged: its crc32 differs from the one its save recorded" in message
    assert f"Restore it from a copy of checkpoint '{TAG2}', or load another complete tag with " \
           f"load_checkpoint(..., tag=...) (other complete tags in the save dir, oldest first: {TAG1})" in message
    (path, client), engine = load(saved, tag=TAG1)  # the other tag is intact
    assert client == {"step": 1} and engine.global_steps == 1


def test_a_truncated_file_is_named_by_its_size(saved):
    target = saved / TAG2 / "mp_rank_00_model_states.pt"
    size = target.stat().st_size
    target.write_bytes(target.read_bytes()[:100])
    with pytest.raises(Exception, match=re.escape(f"{target} is damaged: it has 100 bytes, the save wrote {size}")):
        load(saved)


def test_a_checkpoint_without_checksums_loads_unchecked_and_quietly(saved):
    """Saved by a crew before checksums: no "files" in its manifest."""
    for tag in (TAG1, TAG2):
        manifest = manifest_of(saved / tag)
        del manifest["files"]
        (saved / tag / "crew_checkpoint.json").write_text(json.dumps(manifest))
    said = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("crew").addHandler(handler)
    try:
        (path, client), engine = load(saved)
    finally:
        logging.getLogger("crew").removeHandler(handler)
    assert path == str(saved / TAG2) and client == {"step": 2} and engine.global_steps == 2
    assert said == []
    target = saved / TAG2 / "mp_rank_00_model_states.pt"  # unchecked, a torn file still fails in torch
    target.write_bytes(target.read_bytes()[:100])
    with pytest.raises(Exception, match=rf"{target} cannot be read .* truncated, corrupted"):
        load(saved)


@pytest.mark.parametrize("content, problem", [
    ("", "is empty"), ("  \n", "is empty"), ("\x00\x01", "does not hold a tag name ('\\x00\\x01')"),
    ("../global_step1", "does not hold a tag name ('../global_step1')"),
])
def test_a_damaged_latest_is_an_error_naming_it_and_the_complete_tags(saved, content, problem):
    latest = saved / "latest"
    latest.write_bytes(content.encode("latin-1"))
    with pytest.raises(Exception) as raised:
        load(saved)
    assert (f"{latest} {problem}: it should name the checkpoint tag to load (complete tags in the save dir, "
            f"oldest first: {TAG1}, {TAG2}). To fix it, write the tag to resume from into it (echo {TAG2} > "
            f"{latest}), or pass load_checkpoint(..., tag='{TAG2}')") in str(raised.value)
    (path, _), _ = load(saved, tag=TAG2)  # the fix it names works
    assert path == str(saved / TAG2)


def test_latest_naming_a_missing_or_incomplete_tag_names_it_and_the_complete_tags(saved):
    latest = saved / "latest"
    latest.write_text("global_step9")
    with pytest.raises(Exception, match=re.escape(
            f"{latest} names checkpoint tag 'global_step9', which is not in {saved} (complete tags in the save "
            f"dir, oldest first: {TAG1}, {TAG2}): write a complete tag into it, or pass tag= to load_checkpoint")):
        load(saved)
    (saved / TAG2 / "crew_checkpoint.json").unlink()  # a tag whose save never finished
    latest.write_text(TAG2)
    with pytest.raises(Exception, match=re.escape(
            f"{latest} names checkpoint tag '{TAG2}', which is incomplete: {saved / TAG2} has no "
            f"crew_checkpoint.json, which a save writes last (a save that did not finish, or a folder crew did "
            f"not write) (other complete tags in the save dir, oldest first: {TAG1})")):
        load(saved)


def test_no_latest_loads_nothing_with_a_warning_as_in_deepspeed(tmp_path):
    said = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("crew").addHandler(handler)
    try:
        assert load(tmp_path)[0] == (None, None)
    finally:
        logging.getLogger("crew").removeHandler(handler)
    assert said == [f"no checkpoint to load: {tmp_path} has no 'latest' file (pass tag= to choose one)"]


@pytest.mark.parametrize("text, problem", [
    ('{"tag": "global_step2",\n "world_size" 1}', "is not valid JSON (line 2, column 15: Expecting ':' delimiter)"),
    ("", "is not valid JSON (line 1, column 1: Expecting value)"),
    ("[1, 2]", "holds a JSON list, not the object crew writes"),
    ('{"files": {"rank0.pt": "ab12"}}', 'has a "files" entry that is not {"bytes": <size>, "crc32": <hex>}'),
])
def test_a_malformed_manifest_is_named_with_the_json_problem_and_the_fix(saved, text, problem):
    manifest = saved / TAG2 / "crew_checkpoint.json"
    manifest.write_text(text)
    with pytest.raises(Exception, match=re.escape(
            f"{manifest} {problem}. It is crew's manifest of checkpoint '{TAG2}', written when every file of "
            f"it was saved: restore it from a copy of that tag, or load another complete tag with "
            f"load_checkpoint(..., tag=...) (other complete tags in the save dir, oldest first: {TAG1}).")):
        load(saved)


def test_export_checks_the_files_too(saved, tmp_path_factory):
    from crew.runtime.checkpoint import export

    flip(saved / TAG2 / "mp_rank_00_model_states.pt")
    out = tmp_path_factory.mktemp("out") / "model.pt"
    with pytest.raises(Exception, match=r"mp_rank_00_model_states.pt is damaged: its crc32 differs"):
        export(saved, out)
    (saved / "latest").write_text("")
    with pytest.raises(Exception, match=r"latest is empty"):
        export(saved, out)


# -- two ranks: a failed save removes every rank's staging; a damaged file fails every rank ------------

def two_rank_world(rank: int, folder: str) -> dict:
    """Saves and loads `first` (which files does each rank hash?); then a save that hits a real
    EFBIG on rank 1 (RLIMIT_FSIZE, SIGXFSZ ignored); then damages `third`'s rank1.pt, which only
    rank 1 reads, and loads it on both."""
    import resource
    import signal

    import crew
    from crew.runtime.checkpoint import integrity

    engine, _, _, _ = crew.initialize(model=torch.nn.Linear(64, 64), config=ds_config())
    engine.save_checkpoint(folder, tag="first")
    result = {"weights": {k: v.clone() for k, v in engine.module.state_dict().items()}, "hashed": []}
    digest = integrity.file_digest
    integrity.file_digest = lambda path: result["hashed"].append(path.name) or digest(path)
    engine.load_checkpoint(folder)
    integrity.file_digest = digest
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))  # rank1.pt alone is ~13 kB
    try:
        engine.save_checkpoint(folder, tag="second")
    except crew.errors.CrewError as exc:
        result["save_error"] = str(exc)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    torch.distributed.barrier()
    result["after_failed_save"] = sorted(p.name for p in Path(folder).iterdir())
    result["latest"] = (Path(folder) / "latest").read_text()
    torch.distributed.barrier()
    engine.save_checkpoint(folder, tag="third")
    if rank == 1:
        flip(Path(folder) / "third" / "rank1.pt")
    torch.distributed.barrier()
    try:
        engine.load_checkpoint(folder)
    except crew.errors.CrewError as exc:
        result["load_error"] = str(exc)
    return result


def test_two_ranks_share_the_hashing_clean_up_a_failed_save_and_fail_together_on_damage(tmp_path):
    folder = tmp_path / "ckpt"
    ranks = run_ranks(two_rank_world, 2, str(folder))
    # both ranks read all of first's shared files; each is hashed once, by one of them
    hashed = ranks[0]["hashed"] + ranks[1]["hashed"]
    assert sorted(hashed) == ["crew_state.pt", "mp_rank_00_model_states.pt", "rank0.pt", "rank1.pt"]
    assert "rank0.pt" in ranks[0]["hashed"] and "rank1.pt" in ranks[1]["hashed"]
    for result in ranks:
        assert "save_checkpoint" in result["save_error"] and "rank 1" in result["save_error"]
        assert "File too large" in result["save_error"]
        assert result["after_failed_save"] == ["first", "latest"]  # no .second.partial-* left
        assert result["latest"] == "first"
        assert "failed on 1 rank(s)" in result["load_error"]
        assert f"{folder / 'third' / 'rank1.pt'} is damaged" in result["load_error"]
    engine, _ = single_engine(model=torch.nn.Linear(64, 64))  # on one rank: the previous tag is whole
    path, _ = engine.load_checkpoint(folder, tag="first")
    assert path == str(folder / "first")
    for key, value in ranks[0]["weights"].items():
        assert torch.equal(engine.module.state_dict()[key], value)
    shutil.rmtree(folder)
