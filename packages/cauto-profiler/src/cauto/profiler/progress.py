"""Fraction-done of a profile for a ``progress(phase, done, total)`` callback.

``profile(fn, progress=cb)`` reports two phases, each from 0 up to its total, ``done`` never
decreasing:

* ``"capture"``: 1 step (torch.export of the model; 1/1 at once when a capture is reused);
* ``"symbolic steps"``: the simulated training steps, in graph nodes: per step every forward node,
  every forward node again for its backward (autograd runs them in reverse; the count follows the
  earliest forward node whose backward has run), and 1 for the optimizer step.

Nothing here runs when no callback is given.
"""

from __future__ import annotations

from collections.abc import Callable

ProgressFn = Callable[[str, int, int], None]
"""``progress(phase, done, total)``: called with ``done`` rising to ``total`` within each phase."""

SYMBOLIC_PHASE = "symbolic steps"


class StepProgress:
    """Counts the symbolic run's nodes for one ``progress`` callback (module docstring)."""

    def __init__(self, report: ProgressFn, node_names: list[str], steps: int, train: bool, optimizer: bool):
        self.report = report
        self.position = {name: i for i, name in enumerate(node_names)}
        self.nodes = len(node_names)
        backward = self.nodes if train else 0
        self._offsets = {"forward": 0, "backward": self.nodes, "optimizer": self.nodes + backward,
                         "zero_grad": self.nodes + backward + (1 if train and optimizer else 0)}
        self.per_step = self._offsets["zero_grad"]
        self.total = max(1, steps * self.per_step)
        self.base = 0
        self.done = -1
        self._emit(0)

    def _emit(self, done: int) -> None:
        done = min(done, self.total)
        if done > self.done:
            self.done = done
            self.report(SYMBOLIC_PHASE, done, self.total)

    def mark(self, phase: str, step: int) -> None:
        """A phase of the training loop starts (``run_steps``' mark): everything before it is done."""
        if phase == "end":
            self._emit(self.total)
            return
        self.base = (step - 1) * self.per_step + self._offsets.get(phase, 0)
        self._emit(self.base)

    def forward_done(self, nodes: int) -> None:
        """``nodes`` forward nodes of the current step have run."""
        self._emit(self.base + nodes)

    def backward_at(self, node: str | None) -> None:
        """The backward of forward node ``node`` is running (every later node's backward has run)."""
        i = self.position.get(node)
        if i is not None:
            self._emit(self.base + self.nodes - i)
