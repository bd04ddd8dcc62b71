"""The one benchmark scaffold: timing, copy bandwidth, routing generators and the result files.

Every ``bench_<op>.py`` imports this, so there is one timing helper and one result schema
(PERF.md): ``benchmarks/results/<name>.json`` plus ``<name>.md``. Set ``FP8FLOW_RESULTS_DIR`` to
write elsewhere (the GPU runner writes under ``$OUT``).
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

RESULTS_DIR = Path(os.environ.get("FP8FLOW_RESULTS_DIR", Path(__file__).parent / "results"))
# Inputs are rotated until their total exceeds this, so timings never run out of the 50-60 MB L2.
ROTATE_BYTES = 256 * 2**20


def versions() -> dict[str, str]:
    """torch, triton, torchao and CUDA versions of this process."""
    import triton

    try:
        import torchao

        ao = torchao.__version__
    except Exception as exc:  # torchao is an optional baseline: record why it is missing
        ao = f"unavailable ({type(exc).__name__})"
    return {"torch": torch.__version__, "triton": triton.__version__, "torchao": ao, "cuda": str(torch.version.cuda)}


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def n_rotations(bytes_per_set: int) -> int:
    """How many input sets to rotate so the working set exceeds L2."""
    return max(1, min(64, -(-ROTATE_BYTES // max(bytes_per_set, 1))))


def _warm_up(fn: Callable[..., Any], arg_sets: Sequence[tuple]) -> None:
    for args in arg_sets:  # compile, autotune, allocator: none of it belongs in a timing
        fn(*args)
    torch.cuda.synchronize()


def bench_us_all(fn: Callable[..., Any], arg_sets: Sequence[tuple]) -> list[float]:
    """Each timed run's time of ``fn(*args)`` in microseconds, in order, rotating through ``arg_sets`` (CUDA
    events via do_bench, after a warm-up pass over ``arg_sets`` and do_bench's own warm-up)."""
    import triton.testing

    cycle = itertools.cycle(arg_sets)
    _warm_up(fn, arg_sets)
    ms = triton.testing.do_bench(lambda: fn(*next(cycle)), warmup=25, rep=200, return_mode="all")
    return [t * 1e3 for t in ms]


def bench_us(fn: Callable[..., Any], arg_sets: Sequence[tuple]) -> float:
    """Median time of ``fn(*args)`` in microseconds over :func:`bench_us_all`'s runs (do_bench's median)."""
    return statistics.median(bench_us_all(fn, arg_sets))


# ~1.5 s of GPU sleep at Hopper clocks: longer than the host needs to enqueue the timed steps of any case.
SLEEP_CYCLES = 3_000_000_000


def host_and_device_us(
    step: Callable[[], Any], iters: int = 5, sleep_cycles: int = SLEEP_CYCLES
) -> tuple[float, float]:
    """The host's and the device's microseconds per ``step()``, measured apart: a sleep kernel queued first
    keeps the GPU busy while the host enqueues ``iters`` steps, so no launch waits on the device (the host
    time is its own) and the steps then run back to back (the device time has no gaps for the host).
    Timing a step end to end gives the larger of the two; when the host's is the larger, the step is
    host-bound and its time follows the host CPU's speed. Warm the step up (compile, autotune) first.
    Warns when the sleep ended before the host had enqueued every step (too short a sleep, a step that
    waits on the device, or a launch queue full behind the sleep): the device time then has host gaps."""
    torch.cuda.synchronize()
    torch.cuda._sleep(sleep_cycles)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    host_us = 1e6 * (time.perf_counter() - t0) / iters
    if start.query():
        print(
            f"WARNING host_and_device_us: the GPU went idle waiting for the host ({host_us:.0f} us/step)",
            file=sys.stderr,
        )
    end.record()
    torch.cuda.synchronize()
    return host_us, 1e3 * start.elapsed_time(end) / iters


# device_us: calls per measurement. Their launches queue up behind the sleep, and the CUDA launch queue
# holds ~1000 before the host blocks (and the host's pace leaks back in): keep iters * launches well below.
DEVICE_ITERS = 25
# ~0.1 s at Hopper clocks: enough for a slow host to enqueue DEVICE_ITERS calls of a few launches each,
# short enough that sweeps of many configs stay within minutes (the warning above says when it was not).
DEVICE_SLEEP_CYCLES = 200_000_000


def device_us(fn: Callable[..., Any], arg_sets: Sequence[tuple], iters: int = DEVICE_ITERS, repeats: int = 5) -> float:
    """Device microseconds per ``fn(*args)`` with the host excluded (median of ``repeats`` measurements).

    :func:`host_and_device_us` with ``iters`` calls rotating through ``arg_sets``: the calls' kernels
    run back to back behind a sleep kernel, as in a step where the host runs ahead. Measures every
    kernel ``fn`` launches (all launches of a multi-kernel op, output memsets) and the GPU's own gaps
    between them. Does not measure the host (Python, dispatch, launch calls), which :func:`bench_us`
    includes when it is slower than the device; nor is L2 flushed between calls: only the rotation of
    ``arg_sets`` (larger than L2 in total, :func:`n_rotations`) keeps a call from reading the previous
    call's inputs from L2, and a call's own outputs may still be in L2 for the next. ``fn`` must not
    wait on the device (``.item()``, a host copy), and ``iters`` times its launches per call must stay
    well under ~1000 (the launch queue's depth behind the sleep); both are reported as warnings.
    """
    _warm_up(fn, arg_sets)
    cycle = itertools.cycle(arg_sets)
    runs = [host_and_device_us(lambda: fn(*next(cycle)), iters, DEVICE_SLEEP_CYCLES)[1] for _ in range(repeats)]
    return statistics.median(runs)


# The sentence each memory-bound op's results carry in their notes, saying what device_us is.
DEVICE_NOTE = (
    "device_us: ours' device time per call with the host excluded (calls back to back behind a GPU sleep, "
    "no L2 flush beyond the input rotation); device_pct_of_copy_bw: bytes_moved at device_us against the copy "
    "bandwidth."
)

_COPY_GBPS: float | None = None


def copy_bandwidth_gbps() -> float:
    """Measured device-to-device copy bandwidth (bytes read + written), once per process."""
    global _COPY_GBPS
    if _COPY_GBPS is None:
        n = 1 << 30
        src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
        dst = torch.empty_like(src)
        us = bench_us(lambda: dst.copy_(src), [()])
        _COPY_GBPS = 2 * n / us / 1e3
    return _COPY_GBPS


def skewed_counts(total: int, experts: int, alpha: float = 1.2, empty: int = 2, seed: int = 0) -> list[int]:
    """Zipf-like rows per expert summing to ``total``, with ``empty`` experts getting none."""
    g = torch.Generator().manual_seed(seed)
    w = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** alpha
    w[torch.randperm(experts, generator=g)[:empty]] = 0
    counts = torch.floor(w / w.sum() * total).long()
    counts[int(torch.argmax(w))] += total - int(counts.sum())
    return counts.tolist()


def unaligned_offsets(total: int, experts: int) -> torch.Tensor:
    """int32 CUDA group END offsets of :func:`skewed_counts` (not 128-aligned): ``torch._grouped_mm``'s
    groups as the router makes them, before any padding."""
    return torch.tensor(skewed_counts(total, experts), device="cuda").cumsum(0).to(torch.int32)


def balanced_counts(total: int, experts: int) -> list[int]:
    base = [total // experts] * experts
    base[0] += total - sum(base)
    return base


def row(
    case: str,
    ours_us: float,
    baseline: str,
    baseline_us: float | None,
    *,
    bytes_moved: int | None = None,
    flops: float | None = None,
    device_us: float | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """One result row in the PERF.md schema (speed-up = baseline time / ours); with ``device_us`` (ours,
    :func:`device_us`), also ``device_us`` and ``device_pct_of_copy_bw``, the copy-bandwidth share at it."""

    def pct_of_copy_bw(us: float) -> float | None:
        return round(100 * bytes_moved / us / 1e3 / copy_bandwidth_gbps(), 1) if bytes_moved else None

    gbps = bytes_moved / ours_us / 1e3 if bytes_moved else None
    r = {
        "case": case,
        "ours_us": round(ours_us, 2),
        "baseline": baseline,
        "baseline_us": None if baseline_us is None else round(baseline_us, 2),
        "speedup": None if baseline_us is None else round(baseline_us / ours_us, 3),
        "gbps": None if gbps is None else round(gbps, 1),
        "pct_of_copy_bw": pct_of_copy_bw(ours_us),
        "tflops": None if flops is None else round(flops / ours_us / 1e6, 1),
    }
    if device_us is not None:
        r.update(device_us=round(device_us, 2), device_pct_of_copy_bw=pct_of_copy_bw(device_us))
    r.update(extra)
    return r


def write_results(
    name: str,
    rows: list[dict[str, Any]],
    notes: str = "",
    measured_on: tuple[str, dict[str, str]] | None = None,
) -> Path:
    """Write ``<name>.json`` and a markdown table ``<name>.md`` under RESULTS_DIR; print the table.

    ``measured_on`` = (device, versions) of the machine that measured ``rows`` when the files are
    written elsewhere (a report merged from saved runs); default: this process's.
    """
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    device, versions_ = measured_on or (device_name(), versions())
    doc = {
        "benchmark": name,
        "device": device,
        "versions": versions_,
        "command": "python " + shlex.join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),  # re-runnable as printed
        "date": datetime.date.today().isoformat(),
        "copy_bandwidth_gbps": round(copy_bandwidth_gbps(), 1)
        if torch.cuda.is_available() and not measured_on
        else None,
        "notes": notes,
        "rows": rows,
    }
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines = [
        f"# {name}",
        "",
        f"{doc['device']}; {', '.join(f'{k} {v}' for k, v in doc['versions'].items())}; {doc['date']}",
        f"Command: `{doc['command']}`; copy bandwidth {doc['copy_bandwidth_gbps']} GB/s.",
        "",
        notes,
        "",
        "| " + " | ".join(keys) + " |",
        "|" + "---|" * len(keys),
    ]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    (RESULTS_DIR / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[6:]))
    return path


def routed_expert_ids(
    total_rows: int, top_k: int, experts: int, skewed: bool, seed: int = 0, device: str = "cuda"
) -> torch.Tensor:
    """Router top-k expert ids ``[total_rows // top_k, top_k]`` (int64, as ``torch.topk`` returns).

    Rows per expert are :func:`balanced_counts` or :func:`skewed_counts` (Zipf-like, some experts
    empty), shuffled over (token, slot). Under heavy skew an expert holds more rows than there are
    tokens, so a token may name one expert twice; the kernels treat that as two rows.
    """
    counts = skewed_counts(total_rows, experts, seed=seed) if skewed else balanced_counts(total_rows, experts)
    ids = torch.repeat_interleave(torch.arange(experts), torch.tensor(counts))
    g = torch.Generator().manual_seed(seed)
    return ids[torch.randperm(total_rows, generator=g)].view(-1, top_k).to(device)


def bits_equal(a: Any, b: Any) -> bool:
    """Whether two op results (a tensor, or a tuple/list of tensors or None) are identical bit for bit."""
    if isinstance(a, tuple | list):
        return isinstance(b, tuple | list) and len(a) == len(b) and all(map(bits_equal, a, b))
    if a is None or b is None:
        return a is b
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def versus_baseline(
    case: str,
    ours: Callable[..., Any],
    baseline: Callable[..., Any],
    baseline_name: str,
    arg_sets: Sequence[tuple],
    bytes_moved: int,
    **extra: Any,
) -> dict[str, Any]:
    """One :func:`row`: ``ours`` and ``baseline`` timed on the same rotating inputs, plus ours device-only.

    First checks, on the first input set, that both give the same bits (kept as ``bit_exact``; a
    mismatch is printed, not raised, so the other cases still get measured).
    """
    exact = bits_equal(ours(*arg_sets[0]), baseline(*arg_sets[0]))
    if not exact:
        print(f"WARNING {case}: ours and {baseline_name} differ", file=sys.stderr)
    ours_us, ours_device_us = bench_us(ours, arg_sets), device_us(ours, arg_sets)
    base_us = bench_us(baseline, arg_sets)
    return row(
        case,
        ours_us,
        baseline_name,
        base_us,
        bytes_moved=bytes_moved,
        device_us=ours_device_us,
        bit_exact=exact,
        **extra,
    )


def import_deep_gemm() -> Any | None:
    """DeepGEMM (``deep_gemm``) when importable, else ``None`` after printing why: rows that need it
    are then skipped (``../shared/tools/deepgemm/README.md`` says how to build it on a GPU machine)."""
    try:
        import deep_gemm
    except Exception as exc:  # ImportError, or a build whose CUDA libraries do not load
        print(f"skipping the DeepGEMM rows: deep_gemm is not importable ({type(exc).__name__}: {exc})")
        return None
    return deep_gemm


# NVML's clock event reasons (nvmlClocksEventReason*): the bits of nvidia-smi's clocks_event_reasons.active.
CLOCK_EVENT_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


def decode_clock_reasons(mask: int) -> list[str]:
    """The names of the reasons set in an NVML clock event mask; bits NVML had not named here stay hex."""
    names = [name for bit, name in CLOCK_EVENT_REASONS.items() if mask & bit]
    unknown = mask & ~sum(CLOCK_EVENT_REASONS)
    return names + ([hex(unknown)] if unknown else [])


class ClockSample(NamedTuple):
    """One nvidia-smi line: ``t`` on ``time.monotonic()``'s clock; a field nvidia-smi could not give is None."""

    t: float
    sm_mhz: float | None
    mem_mhz: float | None
    power_w: float | None
    temp_c: float | None
    reasons: int | None  # NVML clock event reason mask


def _number(field: str) -> float | None:
    try:
        x = float(field)
    except ValueError:  # "[N/A]", "[Not Supported]", "[Unknown Error]"
        return None
    return x if math.isfinite(x) else None


def parse_clock_line(line: str, arrival: float) -> ClockSample | None:
    """A :class:`ClockSample` from one ``timestamp, sm, mem, power, temp, reasons`` CSV line that arrived at
    monotonic time ``arrival``, or None for anything else (an error message, a short line).

    The sample is placed at nvidia-smi's own timestamp when that parses and lies within a minute of the
    arrival (a pipe may deliver lines in bursts; the minute guards against a clock or time-zone mismatch),
    else at its arrival."""
    fields = [f.strip() for f in line.split(",")]
    if len(fields) != 6:
        return None
    stamp, sm, mem, power, temp, reasons = fields
    values = [_number(f) for f in (sm, mem, power, temp)]
    try:  # nvidia-smi writes the mask as 0x and 16 hex digits; anything else ("[Not Supported]") is no mask
        mask: int | None = int(reasons, 16) if reasons.lower().startswith("0x") else None
    except ValueError:
        mask = None
    if all(v is None for v in values) and mask is None:
        return None
    t = arrival
    with contextlib.suppress(ValueError):
        wall = datetime.datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp()
        stamped = wall - (time.time() - time.monotonic())
        t = stamped if abs(stamped - arrival) < 60 else arrival
    return ClockSample(t, *values, mask)


def summarize_clocks(samples: Sequence[ClockSample]) -> dict[str, Any]:
    """Median and minimum SM clock (MHz), median memory clock and power (W), hottest temperature (C), the
    union of the clock event reasons over ``samples`` (sorted names; [] when none was active) and their
    count. A value no sample gave is None."""

    def values(name: str) -> list[float]:
        return [v for s in samples if (v := getattr(s, name)) is not None]

    sm, mem, power, temp = values("sm_mhz"), values("mem_mhz"), values("power_w"), values("temp_c")
    masks = [s.reasons for s in samples if s.reasons is not None]
    return {
        "sm_mhz_median": round(statistics.median(sm)) if sm else None,
        "sm_mhz_min": round(min(sm)) if sm else None,
        "mem_mhz_median": round(statistics.median(mem)) if mem else None,
        "power_w_median": round(statistics.median(power), 1) if power else None,
        "temp_c_max": round(max(temp)) if temp else None,
        "throttle_reasons": sorted({n for m in masks for n in decode_clock_reasons(m)}) if masks else None,
        "samples": len(samples),
    }


class ClockInterval:
    """A span of monotonic time marked by :meth:`GpuClockLog.interval`; :meth:`summary` of its samples."""

    def __init__(self, log: GpuClockLog):
        self.log = log
        self.start = time.monotonic()
        self.end: float | None = None  # set when the ``with`` block ends

    def summary(self) -> dict[str, Any]:
        """:func:`summarize_clocks` of the samples taken in the interval (so far, if it is still open).

        Waits up to two sampling periods for a sample from after the interval, so the last one has arrived:
        ask after other work (as :func:`bench_moe_layer.finish_variant` does) and there is nothing to wait for."""
        end = time.monotonic() if self.end is None else self.end
        self.log.wait_for_sample_after(end)
        return summarize_clocks([s for s in list(self.log.samples) if self.start <= s.t <= end])


class GpuClockLog:
    """SM and memory clocks, power, temperature and clock event reasons of one GPU, sampled by
    ``nvidia-smi -lms`` in a background process while the benchmark runs, so that each timing can carry
    the clocks it ran at (issue 11: do the FP8 repetitions' 8-17% swings follow throttled SM clocks?)::

        with GpuClockLog(nvidia_smi_id()) as log:
            with log.interval() as iv:
                ...  # timed work
            iv.summary()  # {"sm_mhz_median": 1980, "throttle_reasons": ["sw_power_cap"], "samples": 12, ...}

    One log per process: nvidia-smi costs a process, not a sample. It never fails the benchmark: without
    nvidia-smi, or when it refuses the query, one warning is printed, ``error`` says why, and every summary
    has None values and 0 samples (as has a log never started).
    """

    FIELDS = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu"
    # NVML renamed the throttle reasons "clock event reasons" in R535: older drivers know only the old name.
    REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")

    def __init__(self, device: int | str = 0, period_ms: int = 50, start_timeout_s: float = 10.0):
        self.device, self.period_ms, self.start_timeout_s = str(device), period_ms, start_timeout_s
        self.samples: list[ClockSample] = []  # appended by the reader thread only
        self.reason_field: str | None = None  # the name that worked
        self.error: str | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> GpuClockLog:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start nvidia-smi, with the older reasons field name if the newer one makes it exit with an error."""
        exe = shutil.which("nvidia-smi")
        errors = [] if exe else ["nvidia-smi not found on PATH"]
        for field in self.REASON_FIELDS if exe else ():
            error = self._launch(exe, field)
            if error is None:
                self.reason_field = field
                return
            errors.append(f"{field}: {error}")
        self.error = "; ".join(errors)
        print(f"WARNING GpuClockLog: no GPU clock samples ({self.error})", file=sys.stderr)

    def _launch(self, exe: str, field: str) -> str | None:
        """Start nvidia-smi querying ``field`` too and wait for its first sample: None once it gives one (or
        is still running at ``start_timeout_s``), else why it did not."""
        cmd = [exe, f"--query-gpu={self.FIELDS},{field}", "--format=csv,noheader,nounits"]
        cmd += ["-lms", str(self.period_ms), "-i", self.device]
        stdbuf = shutil.which("stdbuf")
        cmd = [stdbuf, "-oL", *cmd] if stdbuf else cmd  # line-buffered, should nvidia-smi not flush into a pipe
        try:  # stderr into stdout: nvidia-smi prints some errors on either, and one pipe cannot fill unread
            proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                errors="replace",
            )  # fmt: skip
        except OSError as exc:
            return f"{type(exc).__name__}: {exc}"
        first, ended, other = threading.Event(), threading.Event(), []
        reader = threading.Thread(target=self._read, args=(proc, first, ended, other), daemon=True)
        reader.start()
        first.wait(self.start_timeout_s)
        if self.samples or not ended.is_set():  # sampling, or still starting: samples may come later
            self._proc, self._reader = proc, reader
            return None
        try:  # its output ended: it exits (poll() may not say so yet)
            status = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            status = proc.wait()
        reader.join(1)
        return f"exit status {status}: {' | '.join(other) or 'no output'}"

    def _read(
        self, proc: subprocess.Popen[str], first: threading.Event, ended: threading.Event, other: list[str]
    ) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            sample = parse_clock_line(line, time.monotonic())
            if sample is None:  # an error message: the last few are kept for the warning
                other.append(line.strip()[:200])
                del other[:-3]
            else:
                self.samples.append(sample)
                first.set()
        ended.set()
        first.set()  # start() need not wait on

    def stop(self) -> None:
        """Terminate nvidia-smi (kill it if it lingers) and let the reader thread finish."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=2)
        if proc.stdout is not None:
            proc.stdout.close()

    @contextlib.contextmanager
    def interval(self) -> Iterator[ClockInterval]:
        """Mark the ``with`` block's span; the yielded :class:`ClockInterval` summarizes its samples."""
        iv = ClockInterval(self)
        try:
            yield iv
        finally:
            iv.end = time.monotonic()

    def wait_for_sample_after(self, t: float) -> None:
        """Wait (at most two sampling periods, and only while nvidia-smi runs) for a sample later than ``t``."""
        deadline = time.monotonic() + 2 * self.period_ms / 1e3
        while self._proc is not None and self._proc.poll() is None and time.monotonic() < deadline:
            if self.samples and self.samples[-1].t > t:
                return
            time.sleep(self.period_ms / 4e3)


def nvidia_smi_id(index: int | None = None) -> str:
    """CUDA device ``index`` (default: the current one) as nvidia-smi's ``-i`` takes it: ``GPU-<uuid>``, since
    nvidia-smi numbers GPUs in PCI order whatever CUDA_VISIBLE_DEVICES says; the index where torch has no UUID."""
    index = torch.cuda.current_device() if index is None else index
    uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or "")
    if not uuid:
        return str(index)
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def require_cuda(name: str) -> bool:
    """True on a CUDA machine; otherwise print that ``name`` times GPU kernels and has nothing to do."""
    if torch.cuda.is_available():
        return True
    print(f"{name}: no CUDA device; this benchmark times GPU kernels, nothing to do")
    return False
