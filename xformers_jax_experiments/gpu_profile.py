r"""Where a benchmark case's device time goes: per-kernel time from a JAX profiler trace.

  python -m xformers_jax_experiments.gpu_profile --out=profile.txt  # the default cases
  python -m xformers_jax_experiments.gpu_profile \
      --cases='gpu_attention:impl=cudnn,L=8192,D=64;gpu_linear:variant=chunked,L=8192'

Each case is a benchmark suite's case (``suite:key=value,...`` with the case's parameters) and
is built and compiled exactly as the suite builds it (``bench_lib.program``, so a persistent
compilation cache filled by the suite's run is hit). It runs twice to warm up, then
``--steps`` times under ``jax.profiler.trace``; the device planes of the trace are summed by
kernel name (``bench_lib.trace_device``). Written for GPUs
(``xformers_jax_experiments/gpu_session.sh`` runs it); on a CPU the trace has no device plane,
and the planes it has are listed instead.
"""

from __future__ import annotations

import sys

from absl import app, flags

DEFAULT_CASES = (
    "gpu_attention:impl=pallas flash,L=8192,D=64,mode=fwdbwd",
    "gpu_attention:impl=cudnn,L=8192,D=64,mode=fwdbwd",
    "gpu_attention:impl=jax mgpu,L=8192,D=64,mode=fwdbwd",
    "gpu_attention:impl=pallas flash,L=8192,D=128,mode=fwdbwd",
    "gpu_attention:impl=pallas flash,L=8192,D=64,causal=1,mode=fwdbwd",
    "gpu_linear:variant=chunked,L=8192,mode=fwdbwd",
    "gpu_lra:kind=flash,L=4096,mode=fwdbwd",
    "gpu_lra:kind=performer,L=4096,mode=fwdbwd",
)
_CASES = flags.DEFINE_string(
    "cases", ";".join(DEFAULT_CASES),
    "Cases separated by ';': suite:key=value,... (a suite's case with these parameters; the "
    "first that matches), mode=fwd|fwdbwd (default fwdbwd).")
_STEPS = flags.DEFINE_integer("steps", 3, "Traced steps per case.")
_TOP = flags.DEFINE_integer("top", 8, "Kernels listed per case.")
# Not "out": plot.py defines that flag, and both modules may be imported in one process.
_OUT = flags.DEFINE_string("summary_out", None, "Also write the summary here.")


def _parse(spec: str):
    """``suite:key=value,...`` -> (suite, builder path, params, mode)."""
    from xformers_jax_experiments import benchmark

    suite_name, _, rest = spec.partition(":")
    suite = benchmark.load_suite(suite_name)
    given = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        given[key.strip()] = value.strip()
    mode = given.pop("mode", "fwdbwd")
    for case in suite.cases(False):  # the suite's case with these parameters
        params = case.params
        if all(str(params.get(k)) == v or (isinstance(params.get(k), bool)
                                           and params.get(k) == (v == "1")) for k, v in
               given.items()):
            return suite_name, case.builder, params, mode
    raise ValueError(f"{spec!r}: no case of suite {suite_name!r} has these parameters")


def profile_case(spec: str, steps: int, top: int) -> list[str]:
    import jax

    from xformers_jax_experiments import bench_lib

    suite, builder, params, mode = _parse(spec)
    work = bench_lib._import(builder)(**params)
    f, args, _ = bench_lib._compile(work, mode)
    for _ in range(2):
        jax.block_until_ready(f(*args))
    by_kernel, count, data = bench_lib.trace_device(f, args, steps)
    if not by_kernel:  # another trace layout: say what the device planes hold
        found = [f"{plane.name}: {[line.name for line in plane.lines]}" for plane in data.planes]
        return [f"## {spec}", "  no stream lines in device planes; planes: " + "; ".join(found)]
    total = sum(by_kernel.values())
    lines = [f"## {spec}  ({mode}; {builder} {params})",
             f"device time per step: {total / steps / 1e6:.2f} ms over {len(by_kernel)} "
             f"kernels"]
    for name, ns in by_kernel.most_common(top):
        lines.append(f"  {ns / steps / 1e6:9.3f} ms  {100 * ns / max(total, 1):5.1f}%  "
                     f"x{count[name] // steps:<4d} {name[:110]}")
    return lines


def main(argv) -> None:
    del argv
    out = []
    specs = [s for s in _CASES.value.split(";") if s.strip()]
    for spec in specs:
        try:
            lines = profile_case(spec, _STEPS.value, _TOP.value)
        except Exception as e:  # noqa: BLE001 - one case's failure does not stop the others
            lines = [f"## {spec}", f"  error: {type(e).__name__}: {str(e)[:300]}"]
        print("\n".join(lines), flush=True)
        out += lines + [""]
        if _OUT.value:  # after every case: a run cut short keeps what it profiled
            with open(_OUT.value, "w") as f:
                f.write("\n".join(out))


if __name__ == "__main__":
    sys.exit(app.run(main))
