"""--report-to's reporters (runtime.Reporter) inside the run directory: a link planted where one writes is refused
and its target left untouched, trackio's files land in OUTPUT_DIR/trackio, W&B stays offline unless asked and
never waits at a login prompt."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import checkpoints, runtime

REPO = Path(__file__).resolve().parent.parent


def _planted(out: Path, name: str, tmp_path: Path) -> Path:
    """A link at OUTPUT_DIR/NAME to a directory of someone else's holding one file; returns that directory."""
    target = tmp_path / "victim"
    target.mkdir()
    (target / "keep").write_text("mine")
    out.mkdir(exist_ok=True)
    (out / name).symlink_to(target, target_is_directory=True)
    return target


def _untouched(target: Path) -> bool:
    return sorted(p.name for p in target.iterdir()) == ["keep"] and (target / "keep").read_text() == "mine"


@pytest.mark.parametrize("name", ["tensorboard", "wandb", ".wandb", "trackio"])
def test_a_link_planted_at_a_reporter_directory_is_refused_in_one_line_before_anything_starts(name, tmp_path):
    out = tmp_path / "run"
    target = _planted(out, name, tmp_path)
    with pytest.raises(checkpoints.LinkRefusedError) as refused:
        runtime.refuse_planted_links(out)
    assert str(out / name) in str(refused.value) and len(str(refused.value).splitlines()) == 1
    assert _untouched(target)


def _report_two_rows(out: Path, kind: str) -> int:
    """Rows 0 and 1 sent through a Reporter of `kind`; returns how many were not reported."""
    reporter = runtime.Reporter(kind, out, {"loss": "cispo"})
    for step in (0, 1):
        reporter.report({"step": step, "reward": 0.5})
    failures = reporter.failures
    reporter.close()
    return failures


@pytest.mark.parametrize("kind", ["tensorboard", "wandb", "trackio"])
def test_a_reporter_never_writes_through_a_link_planted_at_its_directory(kind, tmp_path, monkeypatch, capsys):
    """Planted after the run's start-up check (refuse_planted_links): the reporter refuses it itself, says so once,
    and the run goes on; nothing reaches the link's target (trackio is refused before it is even imported)."""
    if importlib.util.find_spec(kind) is None:
        pytest.skip(f"{kind} is not installed")
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "run"
    target = _planted(out, kind, tmp_path)
    assert _report_two_rows(out, kind) == 2
    err = capsys.readouterr().err
    assert f"[report-to] {kind}: step 0 not reported: LinkRefusedError" in err and str(out / kind) in err
    assert _untouched(target)


def test_wandb_keeps_to_output_dir_wandb_when_dot_wandb_is_a_link(tmp_path, monkeypatch):
    """W&B moves its files to an existing OUTPUT_DIR/.wandb: the reporter pins them to OUTPUT_DIR/wandb, offline
    (no WANDB_MODE set: the default is offline)."""
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    target = _planted(out, ".wandb", tmp_path)
    assert _report_two_rows(out, "wandb") == 0
    assert _untouched(target)
    assert list(out.glob("wandb/offline-run-*/run-*.wandb"))  # offline, in the run directory


def test_wandb_online_without_a_key_is_one_line_not_a_login_prompt(tmp_path, monkeypatch, capsys):
    pytest.importorskip("wandb")
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # no saved key
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setattr("builtins.input", lambda *a: pytest.fail("W&B prompted for a key"))
    (tmp_path / "run").mkdir()
    assert _report_two_rows(tmp_path / "run", "wandb") == 2
    err = capsys.readouterr().err
    assert "WANDB_MODE=online needs a W&B key" in err
    assert not list((tmp_path / "run").glob("wandb/*run-*"))  # no run was started


def test_a_wandb_run_id_that_is_a_link_is_not_read(tmp_path, monkeypatch, capsys):
    pytest.importorskip("wandb")
    secret = tmp_path / "secret"
    secret.write_text("abcdef01\n")
    (tmp_path / "run" / "wandb").mkdir(parents=True)
    (tmp_path / "run" / "wandb" / "run_id").symlink_to(secret)
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert _report_two_rows(tmp_path / "run", "wandb") == 2
    assert "LinkRefusedError" in capsys.readouterr().err and secret.read_text() == "abcdef01\n"


TRACKIO_RUN = """
import sys
sys.path.insert(0, {repo!r})
from harness import flags, runtime
args = flags.parse_args(["--report-to", "trackio", "--output-dir", {out!r}])
assert "trackio" in sys.modules  # imported by the flags' check, with TRACKIO_DIR already set
runtime.Path(args.output_dir).mkdir(parents=True)  # as the run's lock makes it
reporter = runtime.Reporter("trackio", runtime.Path(args.output_dir), {{}})
for step in range(3):
    reporter.report({{"step": step, "reward": step / 10}})
assert reporter.failures == 0
reporter.close()
from trackio.sqlite_storage import SQLiteStorage
print(sorted(SQLiteStorage.get_runs("scalerl")))
"""


def test_trackio_files_land_in_the_run_directory_named_for_the_whole_path(tmp_path):
    """In a fresh process, as a run meets it: harness/flags.py imports trackio after setting TRACKIO_DIR, so the
    database is OUTPUT_DIR/trackio's and nothing goes to the home directory's cache; the run is named for the whole
    output path (runs/a/default and runs/b/default stay two runs)."""
    if importlib.util.find_spec("trackio") is None:
        pytest.skip("trackio is not installed: pip install trackio")
    home = tmp_path / "home"
    home.mkdir()
    out = tmp_path / "runs" / "a" / "default"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRACKIO_", "HF_"))}
    env.update(HOME=str(home), HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", TRACKIO_RUN.format(repo=str(REPO), out=str(out))], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out / "trackio" / "scalerl.db").is_file()
    assert str(out.absolute()) in done.stdout
    assert not any(home.rglob("*.db"))  # nothing in ~/.cache/huggingface/trackio


@pytest.mark.parametrize("name", ["tensorboard", "wandb", "trackio"])
def test_a_reporter_directory_another_user_prepared_is_refused(name, tmp_path):
    """A real directory someone else made at OUTPUT_DIR/NAME could hold links under the names the reporter will
    write: refused as the run claims its directory and again as the reporter starts; one the run makes is 0700."""
    if os.geteuid() != 0:
        pytest.skip("making a directory another user owns needs root")
    out = tmp_path / "run"
    (out / name).mkdir(parents=True)
    os.chown(out / name, 12345, 12345)
    with pytest.raises(checkpoints.LinkRefusedError, match=f"^{out / name} belongs to uid 12345"):
        runtime.refuse_planted_links(out)
    with pytest.raises(checkpoints.LinkRefusedError, match=f"^{out / name} belongs to uid 12345"):
        checkpoints.make_run_dir(out / name)
    assert list((out / name).iterdir()) == []
    made = checkpoints.make_run_dir(tmp_path / "fresh")
    assert made.stat().st_mode & 0o777 == 0o700
