"""The truth matrix (bench/truth_matrix.py) names only tests that exist, and its check
catches one that does not."""

from __future__ import annotations

import dataclasses

from bench import truth_matrix


def test_every_row_names_a_test_that_exists() -> None:
    assert truth_matrix.check() == []


def test_a_row_naming_a_missing_test_is_caught() -> None:
    row = dataclasses.replace(truth_matrix.ROWS[0],
                              test=truth_matrix.ROWS[0].test + "_renamed")
    (problem,) = truth_matrix.check((row,))
    assert "no test" in problem and row.engine in problem
