"""A variant's options, declared once (attention/options.py): the declaration reads and checks values the same
way for the constructor, from_softmax, configure and a folder's config.json, and gives default_options."""

from __future__ import annotations

import math

import pytest

from vitconvert.attention import VARIANTS
from vitconvert.attention.options import Option, count_or_pair, number, positive, read_options
from vitconvert.errors import BadValue

EPS = (Option("eps", 1e-6, "added to the normaliser", number, positive),)


def test_values_are_read_to_their_type_and_missing_ones_take_the_default():
    assert read_options(EPS, {"eps": 1}, "toy") == {"eps": 1.0} and isinstance(read_options(EPS, {"eps": 1}, "toy")
                                                                               ["eps"], float)
    assert read_options(EPS, {}, "toy") == {"eps": 1e-6}
    blocks = (Option("blocks", None, "per axis", count_or_pair),)
    assert read_options(blocks, {"blocks": (2, 3)}, "toy") == {"blocks": [2, 3]}  # JSON keeps lists, not tuples
    assert read_options(blocks, {"blocks": None}, "toy") == {"blocks": None}


@pytest.mark.parametrize("given,message", [
    ({"eps": "abc"}, "toy's eps takes a finite number, got 'abc' (default 1e-06)"),
    ({"eps": True}, "toy's eps takes a finite number, got True (default 1e-06)"),
    ({"eps": math.nan}, "toy's eps takes a finite number, got nan (default 1e-06)"),
    ({"eps": -1}, "toy's eps must be positive, got -1 (default 1e-06)"),
    ({"epsilon": 1}, "unknown option 'epsilon' for toy; valid: eps"),
    ([("eps", 1)], "the toy options must be a mapping of names to values, got [('eps', 1)]"),
])
def test_a_refused_value_is_one_line_naming_the_option(given, message):
    with pytest.raises(BadValue) as refused:
        read_options(EPS, given, "toy")
    assert str(refused.value) == message and refused.value.name == "option"


def test_every_variant_declares_json_defaults_its_checks_accept():
    for name, cls in VARIANTS.items():
        assert cls.default_options == {o.name: o.default for o in cls.declared_options}
        assert read_options(cls.declared_options, cls.default_options, name) == cls.default_options
        assert all(o.doc for o in cls.declared_options)
        for option in cls.declared_options:  # help(cls) and `vitconvert list` read the same declaration
            assert f"``{option.name}``" in cls.__doc__


@pytest.mark.parametrize("variant,option,value", [
    ("elu", "eps", 0), ("mhla", "block_side", 0), ("mhla", "lepe_kernel", -1), ("mhla", "exp_sigma", 0),
    ("mhla", "local_threshold", -1), ("mhla", "transform", "gaussian"), ("mhla", "blocks_per_side", [2, 0]),
    ("inline", "local_residual", "yes"), ("ttt", "key_norm_eps", -1.0),
])
def test_constructor_and_from_softmax_refuse_what_the_declaration_refuses(variant, option, value):
    from .helpers import softmax_source

    cls = VARIANTS[variant]
    with pytest.raises(BadValue, match=f"{variant}'s {option} .*, got ") as direct:
        cls(32, num_heads=2, **{option: value})
    assert direct.value.name == option
    with pytest.raises(BadValue, match=f"{variant}'s {option} ") as converted:
        cls.from_softmax(softmax_source(32, 2), **{option: value})
    assert converted.value.name == "option" and str(converted.value) == str(direct.value)


def test_stored_options_are_the_values_as_read():
    attn = VARIANTS["mhla"](32, num_heads=2, blocks_per_side=(1, 2), exp_sigma=2)
    assert attn.options["blocks_per_side"] == [1, 2] and attn.options["exp_sigma"] == 2.0
    assert attn.block_counts == (1, 2)
