"""Errors a user can act on: the CLI prints them without a traceback."""


class UserError(Exception):
    """An error caused by the user's input (a path, a flag, a dataset, a config value)."""


class ServiceError(Exception):
    """A server the run depends on (the vLLM rollout server) died or timed out mid-step: nothing of the step
    was logged, and the run resumes from its last checkpoint once the server is back."""


class NoTrainingStep(UserError):
    """The time budget was spent before the first GRPO step: the run trained nothing, and says so (a retry
    cannot help: the budget counts from the run's start). `held_out`: the held-out check of the starting
    policy (`warm_start/eval/*`), made before the budget ran out, for the run to show it all the same."""

    def __init__(self, message: str, held_out: dict[str, float] | None = None):
        super().__init__(message)
        self.held_out = held_out or {}
