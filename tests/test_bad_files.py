"""Every bad file a user hands the CLI or the loaders is one line that names the file, exit
2, nothing written; written files get the umask's mode. One test per kind: truncated, wrong
type, wrong shape, missing field, unwritable output."""
import json
import os
import stat

import numpy as np
import pytest
import yaml

from ms_efficient.cli import main
from ms_efficient.core.fileio import atomic_write_text

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "configs", "gpt_moe_tiny.yaml")


def _one_line_error(capsys, *needles):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
    return err


def test_trace_of_the_wrong_type_or_shape(tmp_path, capsys):
    out = str(tmp_path / "moe.yaml")
    npy = tmp_path / "t.npy"
    np.save(npy, np.zeros((3, 2, 1, 4)))                              # wrong type: one array
    assert main(["plan", "moe", "--trace", str(npy), "--out", out]) == 2
    _one_line_error(capsys, "t.npy", "single .npy array")
    meta = tmp_path / "meta.npz"
    np.savez(meta, counts=np.ones((4, 2, 1, 4), np.int64), top_k=np.array([1, 2]))
    assert main(["plan", "moe", "--trace", str(meta), "--out", out]) == 2   # wrong shape
    _one_line_error(capsys, "meta.npz", "'top_k' must be one integer", "shape [2]")
    nocounts = tmp_path / "nocounts.npz"
    np.savez(nocounts, steps=np.arange(3))                            # missing field
    assert main(["plan", "moe", "--trace", str(nocounts), "--out", out]) == 2
    _one_line_error(capsys, "nocounts.npz", "no 'counts' array")
    assert not os.path.exists(out)


def test_graph_json_with_a_bad_edge_or_truncated(tmp_path, capsys):
    out = str(tmp_path / "place.yaml")
    g = tmp_path / "g.json"
    g.write_text(json.dumps({"format": "ms_efficient.opgraph", "version": 1, "name": "g",
                             "nodes": [{"name": "a", "op_type": "MatMul"}],
                             "edges": [[["a"], "a"]]}))
    assert main(["plan", "place", str(g), "--out", out]) == 2                  # wrong type
    _one_line_error(capsys, "g.json", "edge 0 must be [src name, dst name]")
    text = g.read_text()
    g.write_text(text[: len(text) // 2])                                      # truncated
    assert main(["plan", "place", str(g), "--out", out]) == 2
    _one_line_error(capsys, "g.json", "not valid JSON")
    assert not os.path.exists(out)


def test_configs_with_a_wrong_cluster_section_or_yaml_syntax(tmp_path, capsys):
    out = str(tmp_path / "mpipe.yaml")
    cases = {"list.yaml": ("cluster: [a, b]\n", "'cluster' must be a mapping"),
             "link.yaml": ("cluster: {preset: ascend910b-1x8, intra_link: 5}\n", "intra_link"),
             "syntax.yaml": ("cluster: {preset: [unclosed\n", "is not valid YAML"),
             "top.yaml": ("- just\n- a list\n", "must hold a mapping")}
    for name, (text, needle) in cases.items():
        (tmp_path / name).write_text(text)
        assert main(["plan", "mpipe", str(tmp_path / name), "--out", out]) == 2, name
        _one_line_error(capsys, name, needle)
    assert not os.path.exists(out)


def test_an_unwritable_output_names_the_output(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    out = str(blocker / "plan.yaml")                     # a path under a regular file
    assert main(["plan", "mpipe", CONFIG, "--out", out]) == 2
    _one_line_error(capsys, out, "cannot write there")


def test_plan_files_with_missing_fields_name_the_file(tmp_path):
    from ms_efficient.memopt.apply import load_plan as load_memopt
    from ms_efficient.place.apply import load_plan as load_place

    place = tmp_path / "place.yaml"
    place.write_text(yaml.safe_dump({"kind": "place", "version": 1, "method": "tga"}))
    with pytest.raises(ValueError, match="place.yaml: placement plan is missing .*'graph'"):
        load_place(str(place))
    mem = tmp_path / "mem.yaml"
    mem.write_text(yaml.safe_dump({"kind": "memopt", "layers": "all"}))
    with pytest.raises(ValueError, match="mem.yaml: 'layers' must be a list"):
        load_memopt(str(mem))
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00 binary")
    with pytest.raises(ValueError, match="bin.yaml' is binary, not YAML text"):
        load_place(str(binary))


def test_written_files_get_the_umask_mode(tmp_path):
    old = os.umask(0o022)
    try:
        path = tmp_path / "plan.yaml"
        atomic_write_text(str(path), "kind: x\n")
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o644        # not mkstemp's 0600
        os.umask(0o077)
        atomic_write_text(str(path), "kind: y\n")
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    finally:
        os.umask(old)
