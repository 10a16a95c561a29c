"""Workflow and Step definitions, the validation of their options, and the ``Registry`` that
holds one Durable's workflows by name."""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from .errors import InvalidDefinition, InvalidKey, InvalidStart, NotConfigured, UnknownWorkflow
from .inputs import check_key
from .limits import Batch, FlowLimit, check_priority

REUSE = ("after_close", "after_failure", "never")
ON_DUPLICATE = ("use_existing", "error", "cancel_existing", "run_again")
IDEMPOTENCY = ("optional", "required", "off")


@dataclass(frozen=True)
class SendEvent:
    """``on_duplicate`` policy: deliver a duplicate start's input to the holder as event ``name``."""

    name: str

    def __post_init__(self) -> None:
        name = self.name
        if not isinstance(name, str) or not name or len(name) > 150 or name.startswith("durable:"):
            raise InvalidDefinition(
                "SendEvent needs an event name of 1 to 150 characters not starting with"
                f" 'durable:', not {name!r}"
            )


def check_on_duplicate(value: Any, workflow: Workflow | None = None) -> str | SendEvent:
    """Return ``value`` if it is a valid ``on_duplicate`` policy, else raise InvalidDefinition;
    given per start (``workflow`` given), ``run_again`` under ``reuse='never'`` is InvalidStart."""
    if not (isinstance(value, SendEvent) or value in ON_DUPLICATE):
        raise InvalidDefinition(
            f"on_duplicate must be one of {ON_DUPLICATE} or SendEvent(name), not {value!r}"
        )
    if workflow is not None and value == "run_again" and workflow.reuse == "never":
        # The run left waiting could never take the key: the holder keeps it when it ends. A
        # start argument, so the start is refused (the definition is refused at definition).
        raise InvalidStart(
            f"on_duplicate='run_again' cannot work with reuse='never' (workflow {workflow.name!r})"
        )
    return value  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Accepts:
    """The input fields one function takes as keyword arguments, read from its signature."""

    who: str  # what the error names: "step 'fetch'", "compensation 'refund' of step 'charge'"
    names: frozenset[str]
    required: frozenset[str]
    any_field: bool  # it has **kwargs


def accepts_of(fn: Callable[..., Any], who: str) -> list[Accepts]:
    """What ``fn`` accepts (empty when it has no signature to read: then it is not checked).

    Positional-only parameters cannot come from the input: without a default they make the
    function impossible to call, so they are refused here (InvalidDefinition).
    """
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins and C callables
        return []
    names, required, any_field = set(), set(), False
    for param in params:
        if param.kind is param.VAR_KEYWORD:
            any_field = True
        elif param.kind is param.POSITIONAL_ONLY and param.default is param.empty:
            raise InvalidDefinition(
                f"{who} has a positional-only parameter {param.name!r}, but it gets the run's input "
                "as keyword arguments: remove the '/' or give the parameter a default"
            )
        elif param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            names.add(param.name)
            if param.default is param.empty:
                required.add(param.name)
    return [Accepts(who, frozenset(names), frozenset(required), any_field)]


@dataclass(frozen=True, eq=False)
class ParallelGroup:
    """The function of a parallel step: the engine starts its branches as child runs, each
    with the run's input, and goes on when all completed (``children.fan_out``)."""

    branches: dict[str, Workflow]
    fail_fast: bool

    def __call__(self, **_input: Any) -> None:
        raise InvalidDefinition("a parallel step runs its branches inside a durable run, not as a call")


@dataclass
class Step:
    """One step of a workflow: a function run as its own Celery task."""

    fn: Callable[..., Any]
    name: str
    index: int
    retry: int = 1
    queue: str | None = None
    compensate: Callable[..., Any] | None = None
    timeout: float | None = None
    backoff: float | None = None
    # Attempts a compensation gets, in all (its own count, apart from the step's).
    compensate_retry: int = 3
    # The step (and its compensation) runs inside a database transaction that commits with
    # durable's record of it (core/atomic.py): its writes on that connection happen once. True,
    # or where the step writes (a Django alias, an Engine, a URL), which must be durable's database.
    atomic: Any = False
    # What the step (and its compensation, or its parallel branches) take of the input.
    accepts: list[Accepts] = field(default_factory=list, repr=False)

    @property
    def task_name(self) -> str:
        """The Celery task name, e.g. ``durable.sync_account.fetch``."""
        return f"durable.{self.workflow_name}.{self.name}"

    workflow_name: str = ""


@dataclass
class Workflow:
    """A named chain of steps with key, reuse and duplicate policies."""

    name: str | None = None
    reuse: str = "after_close"
    on_duplicate: str | SendEvent = "use_existing"
    debounce: dict[str, float] | None = None
    key: str | Callable[[dict[str, Any]], Any] | None = None
    idempotency: str = "optional"
    timeout: float | None = None
    queue: str | None = None
    # Extra metadata for every log line a step logs: a callable on the run input returning a dict.
    log_metadata: Callable[[dict[str, Any]], Mapping[str, Any]] | None = None
    # Flow control per key (limits.py; decided by core/flow.py): given as dicts, kept as FlowLimit.
    concurrency: Any = None
    throttle: Any = None
    rate_limit: Any = None
    # Among runs waiting for the same limit, higher goes first (aged: see core/runs.py); 0 default.
    priority: int = 0
    batch: Any = None  # {"max", "period", "key"}: starts gathered into one run (limits.Batch)
    steps: list[Step] = field(default_factory=list)
    # The registry of the Durable it was defined on (None: shared, or not yet bound).
    registry: Registry | None = field(default=None, repr=False)
    shared: bool = False
    # One-step workflows that parallel step groups run as branches (see ``parallel``).
    branches: list[Workflow] = field(default_factory=list, repr=False)
    # Options of the first step of a workflow made from a function (``@durable.workflow(retry=3)``).
    step_options: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.name is not None and (not isinstance(self.name, str) or not self.name.strip()):
            raise InvalidDefinition(f"a workflow name must be a non-empty str, not {self.name!r}")
        if self.reuse not in REUSE:
            raise InvalidDefinition(f"reuse must be one of {REUSE}, not {self.reuse!r}")
        check_on_duplicate(self.on_duplicate)
        if self.on_duplicate == "run_again" and self.reuse == "never":
            raise InvalidDefinition("on_duplicate='run_again' cannot work with reuse='never'")
        if self.idempotency not in IDEMPOTENCY:
            raise InvalidDefinition(f"idempotency must be one of {IDEMPOTENCY}, not {self.idempotency!r}")
        if self.key is not None and not (isinstance(self.key, str) or callable(self.key)):
            raise InvalidDefinition("key must be a template str or a callable on the input")
        _check_seconds("timeout", self.timeout)
        if self.log_metadata is not None and not callable(self.log_metadata):
            raise InvalidDefinition("log_metadata must be a callable on the run input returning a dict")
        if self.debounce is not None:
            if not isinstance(self.debounce, Mapping) or "period" not in self.debounce:
                raise InvalidDefinition("debounce needs {'period': seconds[, 'timeout': seconds]}")
            _check_seconds("debounce period", self.debounce["period"])
            _check_seconds("debounce timeout", self.debounce.get("timeout"))
        self.concurrency = FlowLimit.parse("concurrency", self.concurrency)
        self.throttle = FlowLimit.parse("throttle", self.throttle)
        self.rate_limit = FlowLimit.parse("rate_limit", self.rate_limit)
        self.priority = check_priority(self.priority, InvalidDefinition)
        self.batch = Batch.parse(self.batch, self.key, self.debounce, self.idempotency)

    # -- definition -------------------------------------------------------------------------

    def step(
        self,
        fn: Callable[..., Any] | None = None,
        *,
        name: str | None = None,
        retry: int = 1,
        queue: str | None = None,
        compensate: Callable[..., Any] | None = None,
        timeout: float | None = None,
        backoff: float | None = None,
        compensate_retry: int = 3,
        atomic: Any = False,
    ) -> Any:
        """Add the next step; use as ``@wf.step`` or ``@wf.step(retry=3, queue="slow")``.

        ``compensate`` is called (with the run's input) when a later step fails for good;
        compensations run in reverse order with ``compensate_retry`` attempts each. ``atomic``:
        the step runs in a transaction on durable's database that commits with durable's record
        of the step (``current_run().connection``; Django: ``transaction.atomic``).
        """

        if self.step_options:
            raise InvalidDefinition(
                f"{', '.join(sorted(self.step_options))}= given to workflow {self.name!r} apply to a "
                "workflow made from a function; give them to .step() instead"
            )

        def add(func: Callable[..., Any]) -> Callable[..., Any]:
            self._add_step(func, name, retry, queue, compensate, timeout, backoff, compensate_retry, atomic)
            return func

        return add(fn) if fn is not None else add

    def _add_step(
        self,
        fn: Callable[..., Any],
        name: str | None,
        retry: int,
        queue: str | None,
        compensate: Callable[..., Any] | None,
        timeout: float | None,
        backoff: float | None,
        compensate_retry: int = 3,
        atomic: Any = False,
    ) -> None:
        if self.name is None:
            raise InvalidDefinition("name the workflow before adding steps")
        if not callable(fn):
            raise InvalidDefinition(f"a step must be callable, not {fn!r}")
        step_name = name or fn.__name__
        if not step_name.replace("_", "").replace("-", "").isalnum():
            raise InvalidDefinition(f"a step name must be letters, digits, '_' or '-': {step_name!r}")
        if any(s.name == step_name for s in self.steps):
            raise InvalidDefinition(f"workflow {self.name!r} already has a step {step_name!r}")
        _check_step_options(retry, compensate, compensate_retry, timeout, backoff, atomic)
        accepts = accepts_of(fn, f"step {step_name!r}")
        if compensate is not None:
            who = f"compensation {getattr(compensate, '__name__', 'function')!r} of step {step_name!r}"
            accepts += accepts_of(compensate, who)
        step = Step(
            fn=fn,
            name=step_name,
            index=len(self.steps),
            retry=retry,
            queue=queue,
            compensate=compensate,
            timeout=timeout,
            backoff=backoff,
            compensate_retry=compensate_retry,
            atomic=atomic,
            workflow_name=self.name,
            accepts=accepts,
        )
        registries = self._registries()
        for registry in registries:
            registry.check(step)
        self.steps.append(step)
        for registry in registries:
            registry.add_step(self, step)

    def _registries(self) -> list[Registry]:
        """The registries that know this workflow: its own, or every Durable's if it is shared."""
        if self.registry is not None:
            return [self.registry]
        return [r for r in list(_live) if self.shared and r.workflows.get(self.name or "") is self]

    def parallel(
        self,
        *fns: Callable[..., Any],
        name: str | None = None,
        fail_fast: bool = True,
        retry: int = 1,
        queue: str | None = None,
        timeout: float | None = None,
    ) -> None:
        """Add a step that runs ``fns`` at once, each as its own task (a branch run with the
        run's input and a copy of its context), and goes on when all have completed; each
        branch's return value lands in the context under the function's name. With
        ``fail_fast`` the first failed branch cancels the others and fails the step."""
        if self.name is None:
            raise InvalidDefinition("name the workflow before adding steps")
        if not fns or not all(callable(fn) for fn in fns):
            raise InvalidDefinition("parallel() takes one or more functions")
        names = [fn.__name__ for fn in fns]
        if len(set(names)) != len(names):
            raise InvalidDefinition(f"parallel branches need distinct names, got {names}")
        group = name or "parallel_" + "_".join(names)
        branches: dict[str, Workflow] = {}
        for fn in fns:
            branch = Workflow(
                name=f"{self.name}.{fn.__name__}", queue=queue or self.queue, shared=self.shared
            )
            branch._add_step(fn, None, retry, None, None, timeout, None)
            branches[fn.__name__] = branch
        self.branches.extend(branches.values())
        if self.registry is not None:
            for branch in branches.values():
                self.registry.register(branch)

        self._add_step(ParallelGroup(branches, fail_fast), group, 1, queue, None, None, None)
        # Each branch gets the run's input: the fan-out step accepts what every branch accepts.
        self.steps[-1].accepts = [
            replace(accepts, who=f"parallel branch {name!r} of step {group!r}")
            for name, branch in branches.items()
            for accepts in branch.steps[0].accepts
        ]

    def __call__(self, fn: Callable[..., Any]) -> Workflow:
        """Decorate a function: it becomes the first step, and names the workflow if unnamed."""
        if not callable(fn) or self.steps:
            raise TypeError("a workflow decorates one function, its first step")
        if self.name is None:
            self.name = fn.__name__
            if self.registry is not None:
                self.registry.register(self)
        given = self.step_options
        retry, compensate_retry = given.get("retry", 1), given.get("compensate_retry", 3)
        compensate, backoff = given.get("compensate"), given.get("backoff")
        atomic = given.get("atomic", False)
        self._add_step(fn, None, retry, None, compensate, None, backoff, compensate_retry, atomic)
        self.step_options = {}
        self.__doc__ = fn.__doc__
        return self

    # -- running ----------------------------------------------------------------------------

    def start(
        self,
        input: Mapping[str, Any] | None = None,
        *,
        key: str | None = None,
        on_duplicate: str | SendEvent | None = None,
        connection: Any = None,
        tags: Mapping[str, str] | None = None,
        priority: int | None = None,
    ) -> str:
        """Start a run of this workflow; returns the run id (see ``Durable.start``)."""
        registry = self.bound()
        if registry.starter is None:
            raise NotConfigured(f"workflow {self.name!r} belongs to a Durable that cannot start runs")
        return registry.starter.start(
            self,
            input,
            key=key,
            on_duplicate=on_duplicate,
            connection=connection,
            tags=tags,
            priority=priority,
        )

    def bound(self) -> Registry:
        """The registry of the Durable this workflow belongs to: its own, or for a shared
        workflow the current Celery app's (like ``shared_task``); NotConfigured if none."""
        if self.registry is not None:
            return self.registry
        registry = current_registry()
        registry.adopt(self)
        return registry

    def derive_key(self, data: dict[str, Any], key: Any) -> str | None:
        """The run's key: the one given, else the workflow's template or callable on the input."""
        if self.idempotency == "off":
            check_key(key)  # still refused when malformed, then ignored
            return None
        if key is None and self.key is not None:
            if callable(self.key):
                key = self.key(data)
            else:
                try:
                    key = self.key.format(**data)
                except (KeyError, IndexError, AttributeError) as exc:
                    self.check_fits(data)  # a step that needs the field says so first
                    raise InvalidKey(f"key template {self.key!r} needs {exc} in the input") from exc
        key = check_key(key)
        if key is None and self.idempotency == "required":
            raise InvalidStart(f"workflow {self.name!r} requires a key")
        return key

    def flow_keys(self, data: dict[str, Any]) -> dict[str, str | None]:
        """A new run's flow-control keys (``slot_key``, ``throttle_key``, ``rate_key``, and
        ``fair_key`` under a fair concurrency limit): None where the workflow has no such limit;
        InvalidStart if a template needs a missing field."""
        limits = {"slot_key": self.concurrency, "throttle_key": self.throttle, "rate_key": self.rate_limit}
        found = {col: None if lim is None else lim.key_for(data, self.name) for col, lim in limits.items()}
        if self.concurrency is not None:
            found["fair_key"] = self.concurrency.fair_key_for(data, self.name)
        return found

    def check_fits(self, data: Mapping[str, Any]) -> None:
        """Raise InvalidStart unless every step (and compensation) can be called with ``data``
        as keyword arguments: no field it does not take, none it needs missing."""
        fields = data.keys()
        for step in self.steps:
            for accepts in step.accepts:
                missing = sorted(accepts.required - fields)
                if missing:
                    raise InvalidStart(
                        f"workflow {self.name!r}: {accepts.who} needs input field {missing[0]!r}, which "
                        "the input lacks; add it to the input, or give the parameter a default"
                    )
                unexpected = [] if accepts.any_field else sorted(fields - accepts.names)
                if unexpected:
                    raise InvalidStart(
                        f"workflow {self.name!r}: {accepts.who} takes no input field {unexpected[0]!r} "
                        "(every step gets the whole input as keyword arguments); remove it from the "
                        "input, or add the parameter or **kwargs to the step"
                    )

    def compensation_before(self, index: int) -> Step | None:
        """The nearest step before ``index`` that has a compensation (they run in reverse)."""
        return next((s for s in reversed(self.steps[:index]) if s.compensate is not None), None)

    def queue_for(self, step: Step, default: str | None) -> str | None:
        """Where a step's messages go: the step's queue, the workflow's, or the app default."""
        return step.queue or self.queue or default


def _check_step_options(
    retry: Any, compensate: Any, compensate_retry: Any, timeout: Any, backoff: Any, atomic: Any = False
) -> None:
    if atomic is None or isinstance(atomic, (int, float)) and not isinstance(atomic, bool):
        raise InvalidDefinition(
            "atomic is True, False, or where the step writes (a Django alias, an Engine, a URL), "
            f"not {atomic!r}"
        )
    for what, count in (("retry", retry), ("compensate_retry", compensate_retry)):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise InvalidDefinition(f"{what} is the number of attempts in all, >= 1, not {count!r}")
    if compensate is not None and not callable(compensate):
        raise InvalidDefinition(f"compensate must be callable, not {compensate!r}")
    _check_seconds("step timeout", timeout)
    _check_seconds("backoff", backoff)


def _check_seconds(what: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise InvalidDefinition(f"{what} must be a positive number of seconds, not {value!r}")


# -- the registry ---------------------------------------------------------------------------


class Starter(Protocol):
    """What starts a run of a workflow (``core.runs.Starter``)."""

    def start(
        self,
        workflow: str | Workflow,
        input: Mapping[str, Any] | None = None,
        *,
        key: str | None = None,
        on_duplicate: str | SendEvent | None = None,
        connection: Any = None,
        tags: Mapping[str, str] | None = None,
        priority: int | None = None,
    ) -> str:
        """Start a run; returns its id or the key's holder's."""
        ...


# Every live registry (one per Durable), and the workflows defined with durable_workflow that
# each of them learns.
_live: weakref.WeakSet[Registry] = weakref.WeakSet()
_shared: list[Workflow] = []


class Registry:
    """The workflows of one Durable by name. ``on_step`` is told of every step added (it makes
    the step's Celery task); ``starter`` starts runs for ``Workflow.start``."""

    def __init__(self, on_step: Callable[[Workflow, Step], None] | None = None) -> None:
        self.workflows: dict[str, Workflow] = {}
        self.on_step = on_step
        # Checks a step before it is added (the Durable's: an atomic step's database).
        self.check_step: Callable[[Step], None] | None = None
        self.starter: Starter | None = None
        _live.add(self)

    def define(self, name: str | Callable[..., Any] | None = None, **options: Any) -> Workflow:
        """A new workflow of this registry; as a decorator on a function it is the first step
        (with that step's options: retry, backoff, compensate, compensate_retry)."""
        if callable(name):
            return Workflow(registry=self)(name)
        workflow = Workflow(name=name, registry=self, **workflow_options(options))
        if name is not None:
            self.register(workflow)
        return workflow

    def register(self, workflow: Workflow) -> None:
        """Add a named workflow (and its parallel branches); InvalidDefinition if the name is taken."""
        assert workflow.name is not None
        existing = self.workflows.get(workflow.name)
        if existing is not None and existing is not workflow:
            raise InvalidDefinition(f"a workflow named {workflow.name!r} is already defined")
        for step in workflow.steps:
            self.check(step)
        self.workflows[workflow.name] = workflow
        for step in workflow.steps:
            self.add_step(workflow, step)
        for branch in workflow.branches:
            if branch.name not in self.workflows:
                branch.registry = workflow.registry
                self.register(branch)

    def check(self, step: Step) -> None:
        """InvalidDefinition when this registry's Durable cannot run ``step`` as defined."""
        if self.check_step is not None:
            self.check_step(step)

    def add_step(self, workflow: Workflow, step: Step) -> None:
        """A step was added to one of these workflows: tell ``on_step``."""
        if self.on_step is not None:
            self.on_step(workflow, step)

    def adopt(self, workflow: Workflow) -> None:
        """Make sure a shared workflow is known here (used by ``Workflow.start``)."""
        if workflow.name not in self.workflows:
            self.register(workflow)

    def adopt_shared(self) -> None:
        """Learn every workflow defined so far with ``durable_workflow``."""
        for workflow in _shared:
            if workflow.name is not None:
                self.register(workflow)

    def resolve(self, workflow: str | Workflow) -> Workflow:
        """The workflow a name or definition stands for here; UnknownWorkflow if none."""
        if isinstance(workflow, Workflow):
            if workflow.name is None:
                raise UnknownWorkflow("this workflow has no name (decorate a function or pass name=)")
            known = self.workflows.get(workflow.name)
            if known is None and workflow.registry is None:
                self.register(workflow)
            elif known is not workflow:
                raise UnknownWorkflow(f"workflow {workflow.name!r} belongs to another Durable")
            resolved = workflow
        elif isinstance(workflow, str) and workflow in self.workflows:
            resolved = self.workflows[workflow]
        else:
            raise UnknownWorkflow(f"no workflow named {workflow!r} is defined")
        if not resolved.steps:
            raise UnknownWorkflow(f"workflow {resolved.name!r} has no steps")
        return resolved


# Options of a workflow made from a function that belong to its one step, not to the workflow
# (``timeout`` and ``queue`` are the workflow's, and so the step's too).
STEP_OPTIONS = ("retry", "backoff", "compensate", "compensate_retry", "atomic")


def workflow_options(options: dict[str, Any]) -> dict[str, Any]:
    """``Workflow`` keyword arguments from a workflow decorator's options: the first step's
    options (``STEP_OPTIONS``, checked here) go under ``step_options``."""
    step = {name: options.pop(name) for name in STEP_OPTIONS if name in options}
    if step:
        _check_step_options(
            step.get("retry", 1),
            step.get("compensate"),
            step.get("compensate_retry", 3),
            None,
            step.get("backoff"),
            step.get("atomic", False),
        )
        options["step_options"] = step
    return options


def share(workflow: Workflow) -> None:
    """Make a workflow known to every Durable, now and later (``durable_workflow``)."""
    workflow.shared = True
    _shared.append(workflow)
    for registry in list(_live):
        registry.register(workflow)


def current_registry() -> Registry:
    """The registry of the Durable bound to Celery's current app, or NotConfigured.

    The one place below ``app.py`` that looks at Celery: the ``shared_task``-style lookup of a
    shared workflow's Durable (``Durable.__init__`` sets ``app._durable_registry``).
    """
    from celery import current_app

    app = current_app._get_current_object()
    registry = getattr(app, "_durable_registry", None)
    if registry is None:
        raise NotConfigured(
            f"no Durable is configured for Celery app {app.main!r}: create Durable(app) "
            "before starting workflows defined with durable_workflow"
        )
    return registry  # type: ignore[no-any-return]
