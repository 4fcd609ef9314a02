"""Safe writers (cauto.plan.writing): atomic, special files refused, symbolic links only on request,
missing folders made, errors that name the user's path and leave no file behind."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from cauto.plan import OutputError, check_output, dump, load, write_atomic


def test_writes_atomically_into_new_folders_and_keeps_an_existing_files_mode(tmp_path, graph):
    path = dump(graph, tmp_path / "a" / "b" / "graph.json")
    assert load(path)["kind"] == "graph" and os.listdir(tmp_path / "a" / "b") == ["graph.json"]
    path.chmod(0o640)
    write_atomic(path, "{}")
    assert path.read_text() == "{}" and (path.stat().st_mode & 0o777) == 0o640


@pytest.mark.parametrize(("make", "words"), [
    (lambda p: os.mkfifo(p), "is a FIFO (named pipe), not a regular file"),
    (lambda p: p.mkdir(), "is a directory, not a regular file"),
])
def test_special_files_are_refused_and_left_alone(tmp_path, make, words):
    target = tmp_path / "out.json"
    make(target)
    kind = target.lstat().st_mode
    with pytest.raises(OutputError, match=re.escape(words)):
        write_atomic(target, "{}")
    assert target.lstat().st_mode == kind and sorted(os.listdir(tmp_path)) == ["out.json"]


def test_a_device_node_is_refused():
    with pytest.raises(OutputError, match="/dev/null is a character device"):
        check_output("/dev/null")


def test_a_symbolic_link_is_replaced_only_when_asked(tmp_path):
    target = tmp_path / "target.json"
    target.write_text("keep")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    with pytest.raises(OutputError, match="is a symbolic link .* pass --replace-symlink"):
        write_atomic(link, "new")
    assert link.is_symlink() and target.read_text() == "keep"
    write_atomic(link, "new", replace_symlink=True)
    assert not link.is_symlink() and link.read_text() == "new" and target.read_text() == "keep"


def test_a_file_in_the_way_of_the_folder_is_named(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(OutputError, match="file/out.json"):
        write_atomic(tmp_path / "file" / "out.json", "{}")


def test_a_failed_write_names_the_users_path_never_the_temp_file(tmp_path):
    """A real write error (files limited to 16 bytes: EFBIG) leaves nothing behind and names out.json only."""
    script = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
              "resource.setrlimit(resource.RLIMIT_FSIZE, (16, 16)); from cauto.plan import write_atomic, OutputError\n"
              "try:\n    write_atomic(sys.argv[1], 'x' * 1000)\nexcept OutputError as exc:\n    print(exc)")
    res = subprocess.run([sys.executable, "-c", script, str(tmp_path / "out.json")], capture_output=True, text=True,
                         timeout=60)
    assert res.stdout.strip() == f"cannot write {tmp_path / 'out.json'}: File too large", res.stdout + res.stderr
    assert os.listdir(tmp_path) == []
