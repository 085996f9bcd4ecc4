"""benchmarks/ab_code.py on CPU: a revision's package exported into a directory that the benchmark
processes then import it from, and the alternating rounds of the copies paired into ratios."""

import os
import shutil
import subprocess

import pytest

from benchmarks import ab, ab_code

_GIT = shutil.which("git") is not None and subprocess.run(
    ["git", "-C", ab_code.ROOT, "rev-parse", "HEAD"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _GIT, reason="needs git and a git checkout")
def test_an_exported_revision_is_what_the_processes_import(tmp_path):
    base = tmp_path / "base"
    ab_code.export("HEAD", str(base))
    assert sorted(os.listdir(base)) == ["fake_impls", "moonep_ops"]
    assert ab_code.package_file(str(base)) == str(base / "moonep_ops" / "__init__.py")
    assert ab_code.package_file(None) == os.path.join(ab_code.ROOT, "moonep_ops", "__init__.py")
    with pytest.raises(ValueError, match="is not empty"):
        ab_code.export("HEAD", str(base))


def test_main_refuses_a_baseline_without_the_package(tmp_path, capsys):
    with pytest.raises(SystemExit):
        ab_code.main([str(tmp_path)])
    assert "moonep_ops imports from" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab_code.main([str(tmp_path / "missing")])
    assert capsys.readouterr().err.rstrip().endswith(f"error: no directory {tmp_path / 'missing'}")


def test_rounds_alternate_the_copies_and_pair_their_samples():
    calls = []
    times = {"base": [100.0, 102.0, 98.0], "current": [90.0, 93.0, 97.0]}

    def run(copy):
        calls.append(copy)
        us = times[copy][sum(c == copy for c in calls) - 1]
        return [{"shape": "s", "token_padding": 128, "samples": {"table": [us]}, "errors": {}},
                {"shape": "t", "token_padding": 1, "samples": {"table": []}, "errors": {"table": "rel err 1"}}]

    rows = ab_code.compare(3, run, ["base", "current"])
    assert calls == ["base", "current", "current", "base", "base", "current"]
    assert rows[0]["samples"] == times
    assert ab.paired_ratios(rows[0], "base")["current"] == pytest.approx((93 / 102, 90 / 100, 97 / 98))
    assert rows[1]["errors"] == {"base": "rel err 1", "current": "rel err 1"}
    assert ab.paired_ratios(rows[1], "base")["current"] is None
    assert "current/base 0.912 (0.900-0.990)" in ab._line(rows[0])


def test_main_passes_the_other_options_to_benchmarks_ab(tmp_path, monkeypatch, capsys):
    base = str(tmp_path)
    monkeypatch.setattr(ab_code, "package_file", lambda directory: os.path.join(base, "moonep_ops", "__init__.py"))
    calls = []

    def run_ab(directory, ab_args, reference):
        calls.append((directory, ab_args, reference))
        return [{"shape": "s", "token_padding": 128, "samples": {"table": [100.0]}, "errors": {}}]

    monkeypatch.setattr(ab_code, "run_ab", run_ab)
    assert ab_code.main([base, "--rounds", "2", "--fp8", "--shapes", "0,3", "--settle", "0.5"]) == 0
    forwarded = ["--fp8", "--shapes", "0,3", "--settle", "0.5"]
    assert [call[:2] for call in calls] == [(base, forwarded), (None, forwarded), (None, forwarded),
                                            (base, forwarded)]
    assert len({call[2] for call in calls}) == 1, "every process checks against the same reference file"
    assert "current/base 1.000" in capsys.readouterr().out


def test_more_copies_take_their_directories_names_and_turns(tmp_path, monkeypatch, capsys):
    dirs = [str(tmp_path / name) for name in ("base_dir", "probe", "other")]
    for directory in dirs:
        os.mkdir(directory)
    monkeypatch.setattr(ab_code, "package_file",
                        lambda directory: os.path.join(os.path.abspath(directory), "moonep_ops", "__init__.py"))
    calls = []
    times = {dirs[0]: 100.0, dirs[1]: 90.0, dirs[2]: 110.0, None: 101.0}

    def run_ab(directory, ab_args, reference):
        calls.append(directory)
        return [{"shape": "s", "token_padding": 128, "samples": {"table": [times[directory]]}, "errors": {}}]

    monkeypatch.setattr(ab_code, "run_ab", run_ab)
    assert ab_code.main([*dirs, "--rounds", "2", "--fp8"]) == 0
    assert calls == [*dirs, None, None, *reversed(dirs)]
    out = capsys.readouterr().out
    for ratio in ("probe/base 0.900", "other/base 1.100", "current/base 1.010"):
        assert ratio in out


@pytest.mark.parametrize("names", [("a", "current"), ("a", "x", "x"), ("a", "base")])
def test_copies_need_different_names(names, capsys):
    with pytest.raises(ValueError, match="the copies need different names"):
        ab_code.copy_names(list(names))
    with pytest.raises(SystemExit):
        ab_code.main(list(names))
    assert "the copies need different names" in capsys.readouterr().err


def test_export_writes_one_directory(tmp_path, capsys):
    with pytest.raises(SystemExit):
        ab_code.main(["--export", "HEAD", str(tmp_path / "a"), str(tmp_path / "b")])
    assert "--export writes one directory" in capsys.readouterr().err

