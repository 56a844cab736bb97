"""The emulator's modelled GPU clock: step deadlines that host work cannot stretch.

A modelled GPU step of ``d`` seconds occupies ``d * time_factor`` wall seconds. Sleeping
``d * time_factor`` after the host work of a step (parsing, hashing, KV bytes, events, Mooncake
calls) would add that work to every step; instead each step ends at a *deadline*: the end of
the previous step (when work was waiting) or the moment its work became runnable (after an
idle spell), plus ``d * time_factor``. Host work between steps then overlaps the modelled
compute, and the modelled timeline (the deadlines) is what the emulator accounts TTFTs on.

When the host cannot keep up (a step starts later than its modelled start by more than
``late_s``), the clock counts it; beyond ``resync_s`` it gives up the lost time (the modelled
timeline restarts at now: the run is slower than its model) and warns, at most every
``warn_every_s``. Pure bookkeeping: the caller sleeps and reads the wall clock.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

log = logging.getLogger("stack.worker")


@dataclass
class ClockStats:
    steps: int = 0
    late_steps: int = 0  # started more than late_s after their modelled start
    resyncs: int = 0  # gave up lost time (the modelled timeline was stretched)
    lost_wall_s: float = 0.0  # wall seconds given up by resyncs (stretch of the model)
    max_lag_s: float = 0.0  # largest wall lag of a step start behind its modelled start
    lag_sum_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        d = dict(vars(self))
        d["mean_lag_s"] = self.lag_sum_s / self.steps if self.steps else 0.0
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in d.items()}


@dataclass
class ModelClock:
    time_factor: float
    late_s: float = 0.005
    resync_s: float = 0.25
    warn_every_s: float = 10.0
    name: str = ""
    free_at: float = 0.0  # wall time the modelled GPU is free again (end of the last step)
    stats: ClockStats = field(default_factory=ClockStats)
    _warned_at: float = -1e18

    def step(self, model_s: float, runnable_at: float, now: float) -> float:
        """The wall deadline of a step of ``model_s`` modelled seconds whose work became
        runnable at ``runnable_at`` (wall), planned at ``now``."""
        start = max(self.free_at, runnable_at)
        lag = max(0.0, now - start)
        st = self.stats
        st.steps += 1
        st.lag_sum_s += lag
        st.max_lag_s = max(st.max_lag_s, lag)
        if lag > self.late_s:
            st.late_steps += 1
        if lag > self.resync_s:
            st.resyncs += 1
            st.lost_wall_s += lag
            start = now
            if now - self._warned_at >= self.warn_every_s:
                self._warned_at = now
                log.warning(
                    "emulator %s fell behind its modelled clock by %.3f s wall (%.2f modelled s; "
                    "%d of %d steps late so far): host work per step exceeds the modelled step "
                    "time at time_factor %g; figures of this run are stretched",
                    self.name,
                    lag,
                    lag / self.time_factor if self.time_factor else 0.0,
                    st.late_steps,
                    st.steps,
                    self.time_factor,
                )
        self.free_at = start + model_s * self.time_factor
        return self.free_at

    def modelled(self, wall_s: float) -> float:
        """Modelled seconds of a wall span."""
        return wall_s / self.time_factor if self.time_factor else wall_s
