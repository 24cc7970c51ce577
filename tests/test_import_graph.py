"""The package's import graph: stages as folders, each importing only from the stages below it.

The layers are the data flow (supervisor/README.md): an entry is read (journal), grouped into
invocations (track), classified (classify), decided (decide), acted on (actions) and told
(notify); the pipeline, the daemon, the app and the commands are built from them. A module may
import from its own layer and the layers before it, never from a later one, and no import,
not even one under `TYPE_CHECKING`, closes a cycle.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "supervisor"

# Lowest first. A prefix names a folder (every module in it) or a single module.
LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "supervisor",
        "supervisor.model",
        "supervisor.records",
        "supervisor.errors",
        "supervisor.util",
    ),
    ("supervisor.story",),
    ("supervisor.engines",),
    ("supervisor.config",),
    ("supervisor.migrations",),
    ("supervisor.state", "supervisor.store", "supervisor.telemetry"),
    ("supervisor.seams",),
    ("supervisor.journal",),
    ("supervisor.environment",),
    # The tracker's parts: what a run keeps and when it settles, its state machine, the tracker.
    ("supervisor.track.retention", "supervisor.track.settle"),
    ("supervisor.track.invocations",),
    ("supervisor.track",),
    ("supervisor.classify",),
    ("supervisor.decide",),
    ("supervisor.actions",),
    ("supervisor.notify",),
    ("supervisor.pipeline",),
    ("supervisor.loop",),
    ("supervisor.daemon",),
    ("supervisor.app",),
    ("supervisor.commands",),
    ("supervisor.cli", "supervisor.__main__"),
    ("supervisor.cli_docs",),  # generated from the parser: above the CLI itself
)
STAGE_FOLDERS = ("journal", "track", "classify", "decide", "actions", "notify", "environment")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def known() -> set[str]:
    """Every module: the Python ones, and the compiled ones by their `.pyi` stubs (`_rows`)."""
    return {*modules(), *(module_name(p) for p in PACKAGE.rglob("*.pyi"))}


def imports_of(path: Path, name: str) -> Iterator[str]:
    """Every module of the package that `path` imports, TYPE_CHECKING blocks included."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.split(".")[0] == "supervisor")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if base.split(".")[0] != "supervisor":
                continue
            for alias in node.names:  # `from supervisor.x import y` may import module x.y
                yield f"{base}.{alias.name}" if f"{base}.{alias.name}" in known() else base


def _named(node: ast.expr) -> str:
    """The name an expression ends in: `x` for `x` and for `self.x`, else ""."""
    if isinstance(node, ast.Name):
        return node.id
    return node.attr if isinstance(node, ast.Attribute) else ""


def layer_of(name: str) -> int:
    best, depth = -1, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > depth:
                best, depth = index, len(prefix)
    if best < 0:
        raise AssertionError(f"{name} belongs to no layer: add it to LAYERS")
    return best


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: set(imports_of(path, name)) - {name} for name, path in found.items()}


class TestLayers:
    def test_every_module_has_a_layer(self) -> None:
        """A new module must be placed in the data flow before it can land."""
        for name in modules():
            layer_of(name)

    def test_no_import_from_a_later_stage(self) -> None:
        """A lower stage never reaches up (the tracker does not know the daemon, a hook does not
        import the daemon it is handed to)."""
        upward = [
            f"{name} (layer {layer_of(name)}) imports {dep} (layer {layer_of(dep)})"
            for name, deps in graph().items()
            for dep in sorted(deps)
            if layer_of(dep) > layer_of(name)
        ]
        assert upward == []

    def test_no_cycle(self) -> None:
        """No chain of imports leads a module back to itself."""
        edges = graph()
        cycles: list[list[str]] = []
        state: dict[str, int] = {}

        def visit(node: str, path: list[str]) -> None:
            state[node] = 1
            for dep in sorted(edges.get(node, ())):
                if state.get(dep) == 1:
                    cycles.append([*path[path.index(dep) :], dep] if dep in path else [node, dep])
                elif dep not in state:
                    visit(dep, [*path, dep])
            state[node] = 2

        for name in sorted(edges):
            if name not in state:
                visit(name, [name])
        assert cycles == []

    @pytest.mark.parametrize("folder", STAGE_FOLDERS)
    def test_each_stage_is_a_folder(self, folder: str) -> None:
        """The listing of supervisor/ reads as the data flow."""
        assert (PACKAGE / folder / "__init__.py").is_file()

    def test_the_layout_rule_is_written_down(self) -> None:
        """supervisor/README.md names every folder this test knows."""
        text = (PACKAGE / "README.md").read_text()
        folders = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
        assert [f for f in folders if f"`{f}/`" not in text] == []

    def test_the_loop_asks_the_pipeline_not_its_tracker_or_policy(self) -> None:
        """The daemon and its loop's parts go through the pipeline's own methods: no import of
        the tracker, no reach into `pipeline.tracker` or `pipeline.policy`."""
        loop = [PACKAGE / "daemon.py", *sorted((PACKAGE / "loop").glob("*.py"))]
        for path in loop:
            name = module_name(path)
            assert not [m for m in imports_of(path, name) if m.startswith("supervisor.track")]
            reaches = [
                node.attr
                for node in ast.walk(ast.parse(path.read_text(), str(path)))
                if isinstance(node, ast.Attribute)
                and node.attr in ("tracker", "policy")
                and _named(node.value).lstrip("_") == "pipeline"
            ]
            assert reaches == [], f"{name} reaches into the pipeline: {reaches}"

    def test_the_checker_sees_an_upward_import(self, tmp_path: Path) -> None:
        """The walk finds imports in TYPE_CHECKING blocks and relative imports."""
        source = tmp_path / "probe.py"
        source.write_text(
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from supervisor.daemon import Daemon\nfrom . import model\n"
        )
        found = set(imports_of(source, "supervisor.track.probe"))
        assert "supervisor.daemon" in found
        assert "supervisor.track.model" in found or "supervisor.track" in found


def exported(folder: str) -> set[str]:
    """The names a stage's `__init__.py` lists in `__all__`."""
    path = PACKAGE / folder / "__init__.py"
    for node in ast.parse(path.read_text(), str(path)).body:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        if isinstance(target, ast.Name) and target.id == "__all__" and node.value is not None:
            return set(ast.literal_eval(node.value))
    raise AssertionError(f"supervisor/{folder}/__init__.py has no __all__")


def stage_imports(path: Path, name: str) -> Iterator[tuple[str, str]]:
    """(what, name) for each name module `name` (at `path`) imports from a stage: `what` is the
    module it names, the stage's package or one of its modules."""
    package = name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[:2][-1] in STAGE_FOLDERS:
                    yield alias.name, "*"
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            parts = base.split(".")
            if parts[0] == "supervisor" and len(parts) > 1 and parts[1] in STAGE_FOLDERS:
                yield from ((base, alias.name) for alias in node.names)


class TestStageFaces:
    @pytest.mark.parametrize("folder", STAGE_FOLDERS)
    def test_each_stage_says_what_commands_may_use(self, folder: str) -> None:
        """Every stage's `__init__.py` has an `__all__`, and each name in it is there."""
        package = importlib.import_module(f"vllm_supervisor.{folder}")
        assert [n for n in sorted(exported(folder)) if not hasattr(package, n)] == []

    def test_commands_use_only_what_the_stages_export(self) -> None:
        """A command imports a stage's names from the stage's package, and only those in its
        `__all__`: what a stage keeps to itself can change without a command noticing."""
        commands = [PACKAGE / "cli.py", *sorted((PACKAGE / "commands").glob("*.py"))]
        stray = [
            f"{module_name(path)}: {what}.{name}"
            for path in commands
            for what, name in stage_imports(path, module_name(path))
            if what.count(".") != 1 or name not in exported(what.split(".")[1])
        ]
        assert stray == []

    def test_the_checker_sees_a_stage_module_import(self, tmp_path: Path) -> None:
        """Importing from a stage's module, not its package, is found, relative or not."""
        source = tmp_path / "probe.py"
        source.write_text(
            "from ..environment.probe import probe\nfrom ..actions import ask\n"
            "import supervisor.track.tracker\n"
        )
        found = set(stage_imports(source, "supervisor.commands.probe"))
        assert found == {
            ("supervisor.environment.probe", "probe"),
            ("supervisor.actions", "ask"),
            ("supervisor.track.tracker", "*"),
        }
