"""`loom simulate`'s use of the step model fitted to published measurements: `calibrate
--published` (refit and write fitted_profiles.json) and the error band a what-if prints."""

from __future__ import annotations

from typing import TYPE_CHECKING

from loom.cli.flags import check_writable

if TYPE_CHECKING:
    from rich.console import Console

    from loom.sim.result import SimConfig


def print_band(console: Console, configs: list[SimConfig]) -> None:
    """Per roofline configuration: where its step model's terms come from, and the fitted
    engine's expected error on rows the fit never saw."""
    from loom.plan.fitted import shipped_profiles

    fitted = shipped_profiles()
    for config in configs:
        meta = config.profile.meta
        if config.profile.source != "roofline" or "serving_engine" not in meta:
            continue
        band = fitted.band(meta["serving_engine"])
        fitted_here = meta["efficiency_source"].startswith("fitted")
        text = band.describe() if band and fitted_here else \
            "expected error: unknown (no held-out published rows for this step model)"
        console.print(f"{config.name}: step model {meta['efficiency_source']}; {text}",
                      highlight=False)


def calibrate_published(output: str | None) -> int:
    """Refit the engines' step models to the published rows; print the fit and held-out bands."""
    from importlib import resources

    from loom.plan.fitted import FILE
    from loom.plan.published import published_rows
    from loom.sim.published_fit import calibrate_published as refit

    path = output or str(resources.files("loom.plan").joinpath(FILE))
    check_writable(path, "--output")
    fitted = refit(published_rows())
    fitted.save(path)
    for engine, per_gpu in fitted.profiles.items():
        for key, entry in per_gpu.items():
            e = entry["efficiency"]
            print(f"{engine} {key}: bandwidth {e['bandwidth']:.2f}, compute {e['compute']:.2f}, "
                  f"interconnect {e['interconnect']:.2f}, overlap {e['overlap']:.0f}, "
                  f"{e['allreduce_hop_s'] * 1e6:.1f} us/all-reduce hop, "
                  f"{e['step_overhead_s'] * 1e3:.2f} ms/step, "
                  f"{e['seq_overhead_s'] * 1e6:.1f} us/seq; train error "
                  f"{entry['train_mean_abs_pct']:.1f}% mean over {entry['train_rows']} rows")
    for engine, band in fitted.held_out.items():
        print(f"{engine}: {band.describe()}")
    print(f"wrote {path}")
    return 0
