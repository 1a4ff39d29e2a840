"""`HostReplay`: a CUDA graph's contract on the host, for CPU tests of the static step's capture / fill / replay
order (engine/runners/static_step.py `GraphCapture`). Set it as a StaticStep's `capturer`."""

from treeserve.engine.runners.static_step import CapturedStep


class HostReplay:
    """A CUDA graph's contract on the host: capture runs the forward (warm-ups, then the captured run) on whatever
    the shared buffers hold; replay reruns it on their current contents and overwrites the captured outputs in
    place. So a step that captured, filled or read in the wrong order gives wrong logits here too."""

    def __init__(self):
        self.bytes = 0
        self.replays = 0

    def capture(self, forward) -> CapturedStep:
        for _ in range(2):
            forward()
        logits, hidden = forward()

        def replay() -> None:
            self.replays += 1
            new_logits, new_hidden = forward()
            logits.copy_(new_logits)
            if hidden is not None:
                hidden.copy_(new_hidden)
        return CapturedStep(replay, logits, hidden)
