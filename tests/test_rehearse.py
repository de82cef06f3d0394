"""bench/rehearse.py: rank 0 of an N-rank step in one process, its peers faked. On the CPU the
tiny model's rehearsals run and report a peak (the process's peak resident set: a rough figure
there, PyTorch's allocated bytes on a GPU) and the bytes each collective was handed; the fake
group lives only inside a rehearsal; bad input is refused before any work; the cheap kernel's
wrapper rebinds FlashAttention-4's window arguments (checked against stand-ins for its two entry
points: FA4 itself needs a GPU)."""

import json
import sys
import types

import pytest
import torch
import torch.distributed as dist

from bench import rehearse


@pytest.fixture
def no_group():
    """A rehearsal's process has no other group; and none is left behind."""
    if dist.is_initialized():
        pytest.skip("a process group from another test is still up in this process")
    yield
    assert not dist.is_initialized(), "the fake group outlived its rehearsal"


def rows_of(result: dict) -> list:
    return [row for run in result["runs"] for row in run["rows"]]


def test_rank_0_of_8_ulysses_untied_and_ring(tmp_path, no_group):
    """--stack 4 (Ulysses), --stack 5 (Untied) and each with --ring 2 (06), rank 0 of 8: each
    step completes with a peak, where it was, the planner's peak, and its collectives' bytes.
    The tiny model has 2 layers (the default depth: no ballast); at 1 layer the missing one's
    gradients come late, when the backward reaches the top block."""
    all_to_all = dist.all_to_all_single
    rehearse.main(["--device", "cpu", "--model", "tiny", "--gpus", "8", "--stack", "4",
                   "--seq-lens", "1K", "--then", "--ring", "2", "--then", "--stack", "5",
                   "--then", "--stack", "5", "--ring", "2", "--layers", "1",
                   "--out", str(tmp_path), "--name", "r"])
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["real"] and result["not_real"]
    runs = result["runs"]
    assert [(run["stack"], run["ring"]) for run in runs] == [(4, None), (4, 2), (5, None), (5, 2)]
    for run in runs:
        assert "error" not in run, run.get("error")
        (row,) = run["rows"]
        assert row["status"] == "completed" and row["rank"] == 0 and row["gpus"] == 8
        assert row["peak_gib"] > 0 and row["peak_at"] and row["planned_peak_gib"] > 0
        assert row["moments"][0]["moment"] == "forward: embedding"
        layers, parts = run["layers"], [label for _, label in rehearse.BLOCK_PARTS]
        assert [m["moment"] for m in row["moments"] if m["moment"].startswith("backward of")] == [
            f"backward of layer {i} of {layers}{part}" for i in reversed(range(layers))
            for part in ["", *(f": {label}" for label in parts)]]
        assert (row["late_gradient_ballast_gib"] > 0) == (layers == 1)
        sent = row["sent_bytes"]
        assert {"all-to-all", "all-gather", "reduce-scatter"} <= set(sent)
        assert ("ring P2P" in sent) == bool(run["ring"])
        assert sent["all-to-all"]["sent_bytes"] > 0
        assert "--stack" in row["train_args"]
    untied = runs[2]["rows"][0]
    assert untied["head_chunk"] == 8 and "--head-chunk" in untied["train_args"]
    assert dist.all_to_all_single is all_to_all  # the counting wrappers are gone


def test_the_fake_group_lives_only_inside(no_group):
    with rehearse.fake_group(8, 3):
        assert (dist.get_world_size(), dist.get_rank()) == (8, 3)
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:  # never joined to, nor replacing, a real group
        with pytest.raises(RuntimeError, match="only group"), rehearse.fake_group(8, 0):
            pass
        assert dist.get_backend() == "gloo"
    finally:
        dist.destroy_process_group()


def test_collectives_are_counted_as_sent_bytes(no_group):
    """Per kind: all-to-all sends (P-1)/P of its input, all-gather its input to P-1 ranks,
    reduce-scatter (P-1)/P, all-reduce twice that, a ring pass its tensors."""
    traffic = rehearse.Traffic()
    with rehearse.fake_group(4, 0), traffic.counting():
        x = torch.zeros(256)  # 1 KiB
        dist.all_to_all_single(torch.empty_like(x), x)
        dist.all_gather_into_tensor(torch.empty(1024), x)
        dist.reduce_scatter_tensor(torch.empty(64), x)
        dist.all_reduce(x)
        for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, 1),
                                               dist.P2POp(dist.irecv, torch.empty_like(x), 3)]):
            request.wait()
    sent = {kind: count["sent_bytes"] for kind, count in traffic.kinds.items()}
    assert sent == {"all-to-all": 768, "all-gather": 3072, "reduce-scatter": 768,
                    "all-reduce": 1536, "ring P2P": 1024}
    assert all(count["calls"] == 1 for count in traffic.kinds.values())


@pytest.mark.parametrize("flags, message", [
    (["--gpus", "3"], "divisible by the sequence-parallel degree"),
    (["--rank", "8"], "--rank must be one of the 8 ranks"),
    (["--window", "256"], "needs FA4 on a GPU"),
    (["--no-host-ballast"], "setting of --offload-model-state"),
    (["--then", "--ring", "3"], "--ring 3"),
])
def test_bad_input_is_refused_before_any_work(flags, message, capsys, no_group):
    argv = ["--device", "cpu", "--model", "tiny", "--gpus", "8", "--stack", "5", "--seq-lens", "1K"]
    with pytest.raises(SystemExit):
        rehearse.main(argv + flags)
    assert message in capsys.readouterr().err


def test_nothing_to_rehearse_is_refused(capsys, no_group):
    with pytest.raises(SystemExit):
        rehearse.main(["--device", "cpu", "--model", "tiny"])
    assert "nothing to rehearse" in capsys.readouterr().err


def test_the_window_replaces_fa4s_arguments(monkeypatch):
    """Stand-ins with FA4's signatures: every forward and backward call gets a causal window of
    W keys, whether the caller passed a window by name, by position or not at all; on the way
    out the entry points are FA4's again."""
    calls = []

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(None, None),
                        return_lse=False):
        calls.append(("forward", causal, window_size))

    def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
                        window_size_left=None, window_size_right=None):
        calls.append(("backward", causal, (window_size_left, window_size_right)))

    package, cute, interface = (types.ModuleType(name) for name in
                                ("flash_attn", "flash_attn.cute", "flash_attn.cute.interface"))
    cute.flash_attn_func, cute.interface = flash_attn_func, interface
    interface.flash_attn_func, interface._flash_attn_bwd = flash_attn_func, _flash_attn_bwd
    package.cute = cute
    for name, module in (("flash_attn", package), ("flash_attn.cute", cute),
                         ("flash_attn.cute.interface", interface)):
        monkeypatch.setitem(sys.modules, name, module)
    with rehearse.windowed_attention(128):
        from flash_attn.cute import flash_attn_func as forward  # as base/kernels.py does
        from flash_attn.cute.interface import _flash_attn_bwd as backward

        forward(1, 2, 3, causal=False, return_lse=True)
        forward(1, 2, 3, None, True, (None, None))
        backward(1, 2, 3, 4, 5, 6, causal=True)
        backward(1, 2, 3, 4, 5, 6, None, False, 0.0, None, None)  # FA4's autograd passes these
        backward(1, 2, 3, 4, 5, 6, window_size_left=7, window_size_right=0)
    assert calls == [("forward", True, (128, 0))] * 2 + [("backward", True, (128, 0))] * 3
    assert cute.flash_attn_func is flash_attn_func and interface._flash_attn_bwd is _flash_attn_bwd
    with rehearse.windowed_attention(0):  # 0: the full kernel, nothing replaced
        assert cute.flash_attn_func is flash_attn_func


def test_two_layers_and_ballast_equal_full_depth_on_the_gpu():
    """The recorded GPU run (docs/results/rehearse_llama3-8b_depth_1m_2m.json: rank 0 of 8 x 80
    GB, Llama-3-8B --stack 5 at 1M and 2M): the 2-layer rehearsal with its ballast, the missing
    layer's pending reduce-scatter input among it, peaks within 0.1 GiB of the same step at full
    depth (32 layers, no ballast), and the planner within 1% of full depth."""
    from pathlib import Path

    result = json.loads((Path(__file__).parents[1] / "docs" / "results"
                         / "rehearse_llama3-8b_depth_1m_2m.json").read_text())
    two, full = ({row["seq_len"]: row for row in run["rows"]} for run in result["runs"])
    assert {row["layers"] for row in two.values()} == {2}
    assert {row["layers"] for row in full.values()} == {32}
    assert sorted(two) == sorted(full) == [2**20, 2**21]
    for seq_len, row in two.items():
        assert row["pending_reduce_scatter_gib"] > 0.8  # 218M fp32 gradients of the layer above
        assert abs(row["peak_gib"] - full[seq_len]["peak_gib"]) < 0.1, (seq_len, row["peak_gib"])
        assert abs(full[seq_len]["planned_peak_gib"] / full[seq_len]["peak_gib"] - 1) < 0.01
