"""CheckOptions: the checks' one frozen options value, its defaults written once, checked in
__post_init__, its flags its own; the public functions' keyword arguments keep working."""

from __future__ import annotations

import dataclasses

import pytest

from amp_rewrite import driver
from amp_rewrite.checks import calibrate, fallback, validate
from amp_rewrite.checks.check_options import CheckOptions, field_names
from amp_rewrite.cli_parser import build_parser
from amp_rewrite.errors import UsageError
from helpers import mlp


def parsed(*flags):
    return CheckOptions.from_args(build_parser().parse_args(["m.onnx", *flags]))


def test_no_flag_given_is_the_defaults_and_every_field_has_a_flag():
    assert parsed() == CheckOptions()
    assert CheckOptions().rtol == 1e-2 and CheckOptions().atol == 1e-3 and not CheckOptions().tf32
    defaults = vars(build_parser().parse_args(["m.onnx"]))
    assert {name: defaults[name] for name in field_names()} == dict.fromkeys(field_names())  # all None
    given = parsed(
        "--validate", "--calibrate", "--tolerance", "--inputs", "s.npz", "--samples", "3", "--rtol", "0.02",
        "--atol", "0", "--safety", "8", "--reference", "never", "--max-runs", "4", "--tf32",
    )  # fmt: skip
    assert given == CheckOptions(True, True, True, "s.npz", 3, 0.02, 0.0, 8.0, 4, False, True)
    assert all(getattr(given, f.name) != f.default for f in dataclasses.fields(CheckOptions))
    assert parsed("--reference").reference is True and parsed("--tf32", "--no-tf32").tf32 is False


def test_frozen_and_checked_however_built():
    options = CheckOptions(rtol=1e-3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.rtol = 1.0
    assert options.replace(atol=0.0).rtol == 1e-3 and CheckOptions(reference="always").reference is True
    for bad, message in [
        ({"safety": 0}, "positive number"),
        ({"rtol": -1}, "at least 0"),
        ({"atol": float("nan")}, "at least 0"),
        ({"max_runs": 0}, "whole number"),
        ({"samples_count": 0, "validate": True}, "at least 1 to validate"),
        ({"reference": "sometimes"}, "True, False or 'auto'"),
        ({"tf32": "yes"}, "True or False"),
    ]:
        with pytest.raises(UsageError, match=message):
            CheckOptions(**bad)
    with pytest.raises(UsageError, match="did you mean 'rtol'"):
        driver.check(mlp(), rtoll=1e-2)
    with pytest.raises(UsageError, match="positive number"):
        calibrate.calibrate(mlp(), safety=0)


def test_the_public_functions_keep_their_keyword_arguments():
    model = mlp()
    samples = validate.synthesise(model, dims={"N": 4}, count=2)
    checked = driver.check(
        model,
        validate=True,
        samples_count=2,
        rtol=1e-2,
        atol=1e-3,
        reference=False,
        provider="cpu",
        dims={"N": 4},
    )
    assert checked.passed and checked.validation.samples == 2 and "reference" not in checked.validation.runs
    result = validate.validate(model, model, samples, rtol=0.0, atol=0.0, reference=False)
    assert result.passed and (result.rtol, result.atol) == (0.0, 0.0)
    fb = fallback.fit(model, samples, rtol=0.0, atol=1e-6, max_runs=3, reference=False, provider="cpu")
    assert fb.runs <= 3 and fb.validation.rtol == 0.0
    assert calibrate.calibrate(model, samples, safety=2.0).safety == 2.0
    by_options = driver.check(model, checks=CheckOptions(validate=True, reference=False), provider="cpu")
    assert by_options.passed and by_options.validation.rtol == CheckOptions.rtol
