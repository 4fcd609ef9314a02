"""cauto.plan.precision: the one rule the solver and the runtime share for moving values in bf16."""

from cauto.plan.precision import bytes_as, cast_on_entry, common_cast


def test_an_op_lowered_by_autocast_casts_its_fp32_inputs():
    assert cast_on_entry("float32", 2, ["bfloat16"]) == "bfloat16"  # linear under bf16 autocast
    assert cast_on_entry("float32", 3, ["float16"]) == "float16"
    # sdpa-style: several bf16 outputs and a non-floating one
    assert cast_on_entry("float32", 4, ["bfloat16", "bfloat16", "int64"]) == "bfloat16"


def test_inputs_taken_as_they_are():
    assert cast_on_entry("bfloat16", 2, ["bfloat16"]) is None   # already in the compute dtype
    assert cast_on_entry("float32", 2, ["float32"]) is None     # an fp32 op (layer norm under autocast)
    assert cast_on_entry("float32", 0, ["bfloat16"]) is None    # a 0-dim scalar takes no part in promotion
    assert cast_on_entry("int64", 2, ["bfloat16"]) is None      # indices
    assert cast_on_entry("float32", 2, ["bfloat16", "float32"]) is None  # mixed outputs: not autocast's
    assert cast_on_entry("float32", 2, ["int64"]) is None


def test_common_cast_and_bytes():
    assert common_cast(["bfloat16", "bfloat16"]) == "bfloat16"
    assert common_cast(["bfloat16", None]) is None
    assert common_cast([]) is None
    assert bytes_as(4096, "float32", "bfloat16") == 2048
    assert bytes_as(4096, "float32", None) == 4096
    assert bytes_as(4096, "int64", "bfloat16") == 4096
