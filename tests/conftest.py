"""Fixtures shared by the model and engine tests (pytest finds them here; modules just name them)."""

from __future__ import annotations

import pytest
import torch
from helpers import oracle


@pytest.fixture(scope="module")
def one_thread():
    """The tiny model's ops are microseconds long: on a shared 2-core machine a second intra-op thread
    makes them several times slower: a module that names it in ``pytestmark`` runs on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ref():
    """``oracle()``: the random-weight HF model, its prompts and its greedy tokens and logits."""
    return oracle()


@pytest.fixture(scope="module")
def model(ref):
    """``PagedLlama`` with the oracle model's weights."""
    from pagedlib.model import PagedLlama

    return PagedLlama.from_hf(ref[0])
