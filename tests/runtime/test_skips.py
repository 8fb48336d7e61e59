"""Skip counters per reason and their warn-once rule (Note: [Never a silent zero])."""

import warnings

import pytest
import torch

import swap_pass
from swap_pass.runtime.stats import SkipReason, record_skip


@pytest.fixture(autouse=True)
def _fresh():
    swap_pass.reset()
    yield
    swap_pass.reset()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_record_skip_counts_bytes_and_tensors_per_reason():
    record_skip(SkipReason.SUBCLASS, 100, where="layers[0]")
    record_skip(SkipReason.SUBCLASS, 50, where="layers[1]")
    record_skip(SkipReason.USER_DATA, 8)
    stats = swap_pass.swap_stats()
    assert stats.skipped_bytes == {"subclass": 150, "user_data": 8}
    assert stats.skips == {"subclass": 2, "user_data": 1}
    assert stats.skipped_user_bytes == 8  # the older field follows its reason


def test_warns_once_per_reason_and_place_until_reset():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            record_skip(SkipReason.SUBCLASS, 1, where="layers[0]")
        record_skip(SkipReason.SUBCLASS, 1, where="layers[1]")
        record_skip(SkipReason.USER_DATA, 1, where="layers[0]")  # quiet reason
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2, messages
    assert "layers[0]" in messages[0] and "subclass" in messages[0]
    swap_pass.reset()
    with pytest.warns(RuntimeWarning, match="subclass"):
        record_skip(SkipReason.SUBCLASS, 1, where="layers[0]")


def test_reset_clears_the_per_reason_counters():
    record_skip(SkipReason.NO_STORAGE, 4, warn=False)
    swap_pass.reset()
    assert swap_pass.swap_stats().skipped_bytes == {}


class _Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_user_data_layer_input_is_counted_by_reason():
    model = _Stack()
    handle = swap_pass.enable_swap_layer_input(model)
    try:
        x = torch.randn(4, 8)  # a user input: never freed
        with pytest.warns(RuntimeWarning, match="a forward kept 1 layer input"):
            model(x).sum().backward()
    finally:
        handle.remove()
    stats = swap_pass.swap_stats()
    assert stats.skipped_bytes.get("user_data") == x.untyped_storage().nbytes()
    assert stats.skips.get("user_data") == 1
