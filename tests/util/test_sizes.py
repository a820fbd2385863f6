"""parse_bytes: what a valid budget is, and a message naming the value for anything else."""

import pytest

from shardplan.util.sizes import parse_bytes


@pytest.mark.parametrize("value, expected", [("60GiB", 60 * 2**30), ("80 GB", 80e9), ("1.5e9", 1.5e9), (" 8e10 ", 8e10),
                                             ("+1KiB", 1024), (1024, 1024), (6e10, 6e10), (2**70, 2**70), ("1b", 1)])
def test_valid_sizes(value, expected):
    assert parse_bytes(value) == int(expected)


@pytest.mark.parametrize("value, says", [
    (float("nan"), "memory_budget=nan is not a number of bytes"),
    ("nan", "memory_budget='nan' is not a number of bytes"),
    (float("inf"), "memory_budget=inf is not a finite number of bytes"),
    ("inf", "memory_budget='inf' is not a finite number of bytes"),
    ("1e400", "memory_budget='1e400' is not a finite number of bytes"),
    (-1, "memory_budget=-1 is not a positive number of bytes"),
    ("-4GiB", "memory_budget='-4GiB' is not a positive number of bytes"),
    (0, "memory_budget=0 is not a positive number of bytes"),
    ("0GiB", "memory_budget='0GiB' is not a positive number of bytes"),
    (0.5, "memory_budget=0.5 is less than one byte"),
    (True, "memory_budget=True is not a number of bytes"),
    ("sixty", "memory_budget='sixty' is not a byte size"),
    ("10 parsecs", "memory_budget='10 parsecs' is not a byte size"),
])
def test_bad_budgets_name_the_value_and_the_fix(value, says):
    with pytest.raises(ValueError) as e:
        parse_bytes(value)
    assert str(e.value).startswith(says + "; give a positive size such as 60e9 or '60GiB'"), str(e.value)
    assert len(str(e.value).splitlines()) == 1


def test_what_names_the_value():
    with pytest.raises(ValueError, match=r"^heap=-1 is not a positive"):
        parse_bytes(-1, what="heap")
    with pytest.raises(ValueError, match=r"^'nan' is not a number of bytes"):    # the CLI names the flag itself
        parse_bytes("nan", what="")
