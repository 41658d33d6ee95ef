"""`expertax steptime PROGRAM`: the report of a saved program, its JSON and plot, and what it
refuses before reading anything (a missing program, no target, a target other than the saved
one's, the CPU, an output that exists, an image suffix it cannot write)."""

from __future__ import annotations

import json

import pytest
from tests.unit.steptime.hlo_text import PARAM, W, all_gather, done, dot, module

from expertax import cli

TEXT = module(
    [PARAM, W, all_gather("s", "a", "{{0,1,2,3,4,5,6,7}}", start=True), dot("d"), done("g", "s")]
)


def test_a_program_reports_its_step_time_json_and_plot(tmp_path, capsys):
    program = tmp_path / "step.hlo"
    program.write_text(TEXT)
    out_json, out_png = tmp_path / "s.json", tmp_path / "s.png"
    args = ["steptime", str(program), "--target", "gpu:h100x8"]
    assert cli.main([*args, "--json", str(out_json), "--plot", str(out_png)]) == 0
    out = capsys.readouterr().out
    assert "predicted from the compiled program, not measured" in out
    r = json.loads(out_json.read_text())
    assert r["seconds"] > 0 and r["communication"][0]["kind"] == "all-gather"
    assert out_png.stat().st_size > 1000
    # a second run refuses to replace them without --overwrite
    assert cli.main([*args, "--json", str(out_json)]) != 0
    assert "--overwrite" in capsys.readouterr().err


def test_the_saved_facts_beside_a_program_give_its_target_and_mesh(tmp_path, capsys):
    program = tmp_path / "step.hlo"
    program.write_text(TEXT)
    meta = {"target": "gpu:h100x8", "mesh": [["fsdp", 8]], "model_flops": 4e9, "tokens": 512}
    (tmp_path / "step.hlo.meta.json").write_text(json.dumps(meta))
    out_json = tmp_path / "s.json"
    assert cli.main(["steptime", str(program), "--json", str(out_json)]) == 0
    r = json.loads(out_json.read_text())
    assert r["target"] == "gpu:h100x8" and r["communication"][0]["mesh_axes"] == ["fsdp"]
    assert r["mfu"] > 0 and r["tokens_per_s_per_device"] > 0
    assert "predicted MFU" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--target", "gpu:h100x8", "--plot", "x.gif"], ".png, .svg or .pdf"),
        ([], "--target is needed"),
        (["--target", "cpu"], "not the CPU"),
        (["--target", "tpu:v9-8"], "--target=tpu:v9-8"),
    ],
)
def test_bad_steptime_input_is_refused_with_a_reason(tmp_path, capsys, extra, says):
    program = tmp_path / "step.hlo"
    program.write_text(TEXT)
    assert (
        cli.main(
            [
                "steptime",
                str(program),
                *[x.replace("x.gif", str(tmp_path / "x.gif")) for x in extra],
            ]
        )
        != 0
    )
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_missing_damaged_and_mismatched_inputs_are_named(tmp_path, capsys):
    assert cli.main(["steptime", str(tmp_path / "none.hlo"), "--target", "gpu:h100x8"]) != 0
    assert "does not exist" in capsys.readouterr().err
    program = tmp_path / "step.hlo"
    program.write_text(TEXT)
    meta = tmp_path / "step.hlo.meta.json"
    meta.write_text("{not json")
    assert cli.main(["steptime", str(program)]) != 0
    assert "damaged" in capsys.readouterr().err
    meta.write_text(json.dumps({"target": "tpu:v5p-16"}))
    assert cli.main(["steptime", str(program), "--target", "gpu:h100x8"]) != 0
    assert "differs from tpu:v5p-16" in capsys.readouterr().err
    program.write_text("not an HLO module\n")
    meta.unlink()
    assert cli.main(["steptime", str(program), "--target", "gpu:h100x8"]) != 0
    assert "cannot be read as optimized HLO" in capsys.readouterr().err


# PROGRAM.meta.json's contents and the words of their refusal (the program is the 8-device TEXT):
# a key of the wrong kind, device counts that are not the target's, a target that is none
META_REFUSED = [
    ({"target": "gpu:h100x8", "mesh": 5}, "mesh=5 is not a list of [axis name, size] pairs"),
    ({"target": "gpu:h100x8", "devices": "eight"}, 'devices="eight" is not a device count'),
    ({"target": "gpu:h100x8", "coords": [[0, "a"]]}, 'coords=[[0, "a"]] is not a list'),
    ({"target": "gpu:h100x8", "tokens": True}, "tokens=true is not a number"),
    ({"target": 8}, "target=8 is not a target"),
    ({"target": "gpu:h100x8", "devices": 4}, "devices=4 says 4 devices, but its target"),
    ({"target": "gpu:h100x8", "mesh": [["data", 3]]}, "its mesh [['data', 3]] holds 3 devices"),
    ({"target": "gpu:h100x8", "coords": [[0, 0, 0]]}, "its device coordinates place 1 devices"),
    ({"target": "tpu:nosuch-16"}, "step.hlo.meta.json: target=tpu:nosuch-16: a TPU slice is"),
    (
        {"target": "cpu"},
        "target=cpu: a step time is predicted for a TPU or GPU target, not the CPU; compile it",
    ),
    ({}, "--target is needed: {meta} names none"),
    ({"mesh": [["data", 8]]}, "--target is needed: {meta} names none"),
]


@pytest.mark.parametrize("meta, words", META_REFUSED)
def test_what_program_meta_json_says_is_checked(tmp_path, capsys, meta, words):
    """Each key of the facts beside a program has its kind and agrees with the target's device
    count; where the target came from the file, the file is named, not --target."""
    program = tmp_path / "step.hlo"
    program.write_text(TEXT)
    (tmp_path / "step.hlo.meta.json").write_text(json.dumps(meta))
    assert cli.main(["steptime", str(program)]) == 2
    err = capsys.readouterr().err
    assert words.format(meta=f"{program}.meta.json") in err and err.count("\n") == 1, err


def test_meta_json_agreeing_with_the_target_and_unknown_keys_pass(tmp_path, capsys):
    """Negative control: the counts of an 8-GPU target, and a key of the user's own (ignored)."""
    program = tmp_path / "step.hlo"
    program.write_text(TEXT)
    meta = {"target": "gpu:h100x8", "devices": 8, "mesh": [["fsdp", 8]], "note": "mine"}
    (tmp_path / "step.hlo.meta.json").write_text(json.dumps(meta))
    assert cli.main(["steptime", str(program)]) == 0
    (tmp_path / "step.hlo.meta.json").write_text(json.dumps({**meta, "target": None}))
    assert cli.main(["steptime", str(program), "--target", "gpu:h100x8"]) == 0


def test_a_truncated_program_is_named_as_such(tmp_path, capsys):
    """A program cut short (its last computation without its closing brace) is refused, not
    predicted from the part that is there."""
    program = tmp_path / "step.hlo"
    program.write_text(TEXT.rstrip().removesuffix("}").rstrip() + "\n")
    assert cli.main(["steptime", str(program), "--target", "gpu:h100x8"]) == 2
    err = capsys.readouterr().err
    assert "is truncated: computation 'main' has no closing brace" in err
