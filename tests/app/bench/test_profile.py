"""``python -m app.bench.profile``: per-step counts on the CPU, and the CUDA counts from a
trace of the shape the profiler records on a GPU (this machine may have none)."""

import json

import pytest
import torch

from app.bench.profile import HOST, STEP, Event, main, short_name, summarize

pytestmark = pytest.mark.usefixtures("one_thread")


def test_profile_runs_on_cpu_and_writes_json(tmp_path, capsys):
    argv = ["--device", "cpu", "--heads", "softmax", "matmul", "adaptive", "--vocab", "300",
            "--hidden", "16", "--tokens", "64", "--warmup", "1", "--steps", "2", "--cutoffs",
            "50", "150", "--out", str(tmp_path), "--name", "profile_cpu"]  # fmt: skip
    main(argv)
    report = json.loads((tmp_path / "profile_cpu.json").read_text())
    assert report["schema"] == "profile/1" and report["args"]["vocab"] == 300
    assert {"platform", "torch", "threads", "device", "load_average"} <= set(report["machine"])
    rows = {r["head"]: r for r in report["results"]}
    assert list(rows) == ["softmax", "matmul", "adaptive"]
    for row in rows.values():
        assert row["host_ms"] > 0 and row["wall_ms"] >= row["host_ms"]
        assert len(row["host_times_ms"]) == len(row["steps"]) == 2
        assert 0 < row["aten_ops_top"] <= row["aten_ops"]
        assert all(s["aten_ops"] == row["aten_ops"] for s in row["steps"])  # the same work
        assert row["outside_ops_ms"] >= 0 and 0 <= row["outside_ops_share"] <= 1
        assert all(row[key] is None for key in ("kernels", "kernel_ms", "syncs"))  # CUDA only
        assert row["top_of"] == "host" and 0 < len(row["top"]) <= 10
        assert all(0 <= t["share"] <= 1 and t["ms_per_step"] >= 0 for t in row["top"])
    # the bare matmul's step is three products: fewer operators than any head's
    assert rows["matmul"]["aten_ops"] < rows["softmax"]["aten_ops"]
    assert rows["matmul"]["aten_ops_top"] < rows["softmax"]["aten_ops_top"]
    assert any(t["name"] == "aten::mm" for t in rows["matmul"]["top"])
    printed = capsys.readouterr().out
    assert "aten ops" in printed and "top host events by self time" in printed


def test_the_whole_language_model_is_profiled_around_a_head(tmp_path):
    """``--scope lm``: the LSTM's step around the head, more operators than the head alone,
    and the scope in the rendered sentence."""
    from app.results import render_profile

    def profile(scope: str) -> dict:
        argv = ["--device", "cpu", "--heads", "mixtape", "--vocab", "200", "--hidden", "16",
                "--tokens", "70", "--warmup", "1", "--steps", "1", "--scope", scope,
                "--out", str(tmp_path), "--name", f"profile_{scope}"]  # fmt: skip
        return main(argv)

    head, lm = profile("head"), profile("lm")
    assert lm["args"]["scope"] == "lm"
    assert lm["results"][0]["aten_ops"] > head["results"][0]["aten_ops"]
    text = render_profile(lm, tmp_path / "profile_lm.json", tmp_path)
    assert "whole LSTM language model" in text and "--scope lm" in text


def test_a_profile_cut_short_keeps_the_subjects_it_finished():
    """The report so far is handed to ``save`` after each subject but the last, marked
    ``partial``; the returned report is whole."""
    from app.bench.profile import parse_args, run

    args = parse_args(["--device", "cpu", "--heads", "softmax", "matmul", "--vocab", "300",
                       "--hidden", "16", "--tokens", "32", "--warmup", "0",
                       "--steps", "1"])  # fmt: skip
    saved = []
    final = run(args, saved.append)
    assert [(r["partial"], [row["head"] for row in r["results"]]) for r in saved] == [
        ("1 of 2 subjects", ["softmax"])
    ]
    assert "partial" not in final and [r["head"] for r in final["results"]] == ["softmax", "matmul"]


def test_the_profile_renders_in_the_results_document(tmp_path):
    from app.results import render

    main(["--device", "cpu", "--heads", "softmax", "matmul", "--vocab", "200", "--hidden", "8",
          "--tokens", "32", "--warmup", "0", "--steps", "1", "--out", str(tmp_path), "--name",
          "profile_tiny", "--note", "A note."])  # fmt: skip
    text = render(tmp_path, tmp_path)
    assert "no renderer knows" not in text
    section = text[text.index("### profile_tiny") :]
    assert section.startswith("### profile_tiny\n\nA note.\n\nPer training step")
    assert "python -m app.bench.profile --heads softmax matmul " in section
    assert "| head | host ms | aten ops | top-level ops | % outside ops | top (share) |" in section
    assert "| matmul |" in section and "`aten::mm`" in section
    assert "host ms per step (aten ops): softmax " in text  # the summary's headline


def test_a_bad_subject_or_device_is_one_error_line(tmp_path, capsys):
    from app.cli.console import exit_status

    with pytest.raises(SystemExit) as stopped:
        main(["--heads", "softmax", "nohead", "--out", str(tmp_path)])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert stopped.value.code == 2 and len(errors) == 1
    assert "unknown subject 'nohead'" in errors[0]
    # what the machine has not got: one line from the build, no traceback
    argv = ["--device", "cpu", "--heads", "softmax@cce", "--vocab", "100", "--hidden", "8",
            "--tokens", "8", "--out", str(tmp_path)]  # fmt: skip
    assert exit_status(lambda: main(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: loss backend 'cce' runs on CUDA only") and "\n" not in err


def _cuda_step(offset: float, gemm_us: float) -> list[Event]:
    """One profiled step as a CUDA trace has it (microseconds from ``offset``): two launches,
    an ``.item()`` (a DtoH copy and a stream sync) inside the step, the closing sync after it."""
    t = offset
    return [
        Event(STEP, "marker", t, t + 100),
        Event(HOST, "marker", t, t + 60),
        Event("aten::linear", "cpu", t + 2, t + 20, 4.0, top=True),
        Event("aten::mm", "cpu", t + 5, t + 20, 5.0),
        Event("cudaLaunchKernel", "runtime", t + 10, t + 12, 2.0),
        Event("aten::_local_scalar_dense", "cpu", t + 30, t + 55, 3.0, top=True),
        Event("cudaLaunchKernel", "runtime", t + 31, t + 33, 2.0),
        Event("cudaMemcpyAsync", "runtime", t + 34, t + 36, 2.0),
        Event("cudaStreamSynchronize", "runtime", t + 40, t + 50, 10.0),
        Event("cudaDeviceSynchronize", "runtime", t + 65, t + 95, 30.0),  # the tool's own sync
        Event("void gemm<128>(float const*, float*)", "kernel", t + 20, t + 20 + gemm_us),
        Event("reduce_kernel", "kernel", t + 20 + gemm_us, t + 25 + gemm_us),
        Event("Memcpy DtoH (Device -> Pageable)", "copy", t + 45, t + 46),
    ]


def test_cuda_counts_from_a_trace():
    """Kernels and copies are counted up to the step's closing sync, host calls inside the step
    only (the tool's own sync is not the head's); a warm-up step outside the markers is not
    counted; the top kernels are ranked by device time with their share of it."""
    warm = [Event("warm_kernel", "kernel", 0, 50), Event("cudaLaunchKernel", "runtime", 1, 2)]
    events = warm + _cuda_step(100, gemm_us=20) + _cuda_step(300, gemm_us=24)
    summary = summarize(events, cuda=True, top=2)
    first, second = summary["steps"]
    assert first == {"profiled_host_ms": 0.06, "aten_ops": 3, "aten_ops_top": 2,
                     "outside_ops_ms": pytest.approx(0.032),
                     "outside_ops_share": pytest.approx(32 / 60), "kernels": 2, "launch_calls": 2,
                     "kernel_ms": pytest.approx(0.025), "copies": 1,
                     "device_ms": pytest.approx(0.026), "syncs": 1, "dtoh_copies": 1,
                     "triton_launches": 0}  # fmt: skip
    assert second["kernel_ms"] == pytest.approx(0.029)
    assert summary["top_of"] == "device"
    top = summary["top"]
    assert [t["name"] for t in top] == ["void gemm<128>(float const*, float*)", "reduce_kernel"]
    assert top[0]["ms_per_step"] == pytest.approx(0.022)  # the median of 20 and 24 us
    assert top[0]["share"] == pytest.approx(22 / 28)  # of the median step's 26 and 30 us
    # and the host's calls by self time, beside the kernels (what a host-bound step waits on)
    host = summary["top_host"]
    assert [t["name"] for t in host] == ["cudaStreamSynchronize", "aten::mm"]
    assert host[0]["ms_per_step"] == pytest.approx(0.010)
    assert host[0]["share"] == pytest.approx(10 / 60)  # of the step's 60 us of host time
    with pytest.raises(ValueError, match="marker"):
        summarize(warm, cuda=True)


def test_kernel_names_are_shortened_for_tables():
    name = ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, "
            "float, at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, "
            "float const*, int)")  # fmt: skip
    assert short_name(name, 200) == (
        "cunn_SoftMaxForward<4, float, float, float, LogSoftMaxForwardEpilogue>"
    )
    assert short_name(name, 20) == "cunn_SoftMaxForwa..."
    assert short_name("triton_red_fused__log_softmax_0") == "triton_red_fused__log_softmax_0"
    assert short_name("aten::mm") == "aten::mm"


def test_events_without_an_activity_type_are_told_apart_by_device_and_name():
    """torch before 2.12 (the GPU machines' 2.11) gives ``FunctionEvent`` no activity type:
    runtime calls, operators, kernels and copies are then told apart by device and name."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from app.bench.profile import event_kind

    def event(name, device=DeviceType.CPU, **extra):
        return SimpleNamespace(name=name, device_type=device, **extra)

    names = ("cudaLaunchKernel", "cuMemcpyDtoH_v2", "cudaStreamSynchronize", "aten::mm",
             "CompiledLinearLSE", "profile.step", "cutlass_op")  # fmt: skip
    kinds = ["runtime", "runtime", "runtime", "cpu", "cpu", "cpu", "cpu"]
    assert [event_kind(event(name)) for name in names] == kinds
    assert event_kind(event("void gemm<128>()", DeviceType.CUDA)) == "kernel"
    assert event_kind(event("Memcpy DtoH (Device -> Pageable)", DeviceType.CUDA)) == "copy"
    assert event_kind(event("Memset (Device)", DeviceType.CUDA)) == "copy"
    # the markers' spans on the device's timeline (torch 2.11 on an H200 counted
    # profile.host's 12.7 ms a step as a kernel)
    assert event_kind(event("profile.host", DeviceType.CUDA)) is None
    assert event_kind(event("profile.step", DeviceType.CUDA)) is None
    # where the profiler names the activity, that decides
    assert event_kind(event("x", activity_type="kernel")) == "kernel"
    assert event_kind(event("x", activity_type="gpu_user_annotation")) is None


def test_cuda_plans_on_a_cpu_count_what_a_launch_bound_gpu_step_dispatches():
    """``--plans cuda``: the GPU's plans on this CPU (a small Mixtape or softmax step plainly,
    one compiled function or one product and a log-softmax), counted against the CPU's own
    plans; the switch is off again afterwards."""
    from app.bench.profile import parse_args, run
    from heads.kernels.chunks import GPU_PLAN_DEVICES

    argv = ["--device", "cpu", "--heads", "softmax", "mixtape", "--vocab", "1000", "--hidden",
            "16", "--tokens", "32", "--warmup", "2", "--steps", "1", "--threads", "1"]  # fmt: skip
    counts = {}
    for plans in ("device", "cuda"):
        report = run(parse_args([*argv, "--plans", plans]))
        counts[plans] = {r["head"]: r["aten_ops_top"] for r in report["results"]}
        assert report["args"]["plans"] == plans
    torch._dynamo.reset()
    assert GPU_PLAN_DEVICES == {"cuda"}
    for head in ("softmax", "mixtape"):
        assert counts["cuda"][head] < counts["device"][head] / 2, counts


def test_triton_stubbed_counts_each_launch_of_the_rows_plans_tiles():
    """``--triton stub``: the rows plans' Triton tiles on this CPU as on a GPU with Triton,
    each launch one host event that runs nothing; the switches are off again afterwards. The
    host operators a step dispatches are held to their count of 2026-11-27 (74 and 167 the
    stop before: one tile's step slices nothing, a mean's weights come with their unit)."""
    pytest.importorskip("triton", reason="Triton is an optional GPU extra")
    from triton.runtime import interpreter

    from app.bench.profile import parse_args, run
    from heads.kernels import rows_ce

    launch = interpreter.GridExecutor.__call__
    argv = ["--device", "cpu", "--plans", "cuda", "--triton", "stub", "--heads", "softmax@rows",
            "mixtape@rows", "--vocab", "1000", "--hidden", "16", "--tokens", "32", "--saved-mb",
            "0", "--warmup", "1", "--steps", "1", "--threads", "1"]  # fmt: skip
    report = run(parse_args(argv))
    torch._dynamo.reset()
    assert not report["failed"]
    rows = {r["head"]: r for r in report["results"]}
    assert {head: row["triton_launches"] for head, row in rows.items()} == {
        "softmax@rows": 1, "mixtape@rows": 3}  # fmt: skip
    assert rows["softmax@rows"]["aten_ops_top"] <= 50, rows["softmax@rows"]["aten_ops_top"]
    assert rows["mixtape@rows"]["aten_ops_top"] <= 120, rows["mixtape@rows"]["aten_ops_top"]
    assert rows_ce.TRITON_DEVICES == ("cuda",) and interpreter.GridExecutor.__call__ is launch


def test_triton_stub_goes_with_cuda_plans_on_a_cpu(capsys):
    from app.bench.profile import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--device", "cpu", "--triton", "stub", "--heads", "softmax"])
    assert "--triton stub goes with --plans cuda" in capsys.readouterr().err
