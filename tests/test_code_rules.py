"""Rules the code itself must keep, checked on its syntax tree: safe loading, and no collective that only rank 0
reaches."""
import ast
import subprocess
import sys

import pytest

from helpers import REPO

# no venvs
SOURCES = sorted(p for p in REPO.rglob("*.py") if not any(part.startswith(".") for part in p.relative_to(REPO).parts))
TRAINING_SCRIPTS = ["ddp_pretrain.py", "fsdp1_pretrain.py", "fsdp2_pretrain.py", "fsdp2_tp_pretrain.py",
                    "fsdp2_cp_pretrain.py", "fsdp2_3d_pretrain.py", "pp_pretrain.py", "fsdp2_muon_pretrain.py",
                    "fsdp2_sft.py", "fsdp2_grpo.py"]


def calls(tree):
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)]


def call_name(call):
    """`torch.load` for torch.load(...), `dist.barrier` for dist.barrier(...), `evaluate` for evaluate(...)."""
    parts, func = [], call.func
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        parts.append(func.id)
    return ".".join(reversed(parts))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_torch_load_only_with_weights_only_and_no_remote_code(path):
    tree = ast.parse(path.read_text())
    for call in calls(tree):
        keywords = {k.arg: k.value for k in call.keywords}
        if call_name(call) == "torch.load":  # weights_only=True unpickles tensors and plain data, never code
            assert isinstance(keywords.get("weights_only"), ast.Constant) and keywords["weights_only"].value is True, \
                f"{path.name}:{call.lineno}: torch.load without weights_only=True"
        assert "trust_remote_code" not in keywords, \
            f"{path.name}:{call.lineno}: trust_remote_code runs a download's code"


# Calls that every rank must make together: torch.distributed and DCP, FSDP's full_tensor, the model's forward
# (FSDP gathers parameters in it), generation, and the scripts' own functions built on these.
COLLECTIVE = ("dist.", "dcp.", "get_model_state_dict", "get_optimizer_state_dict", "set_model_state_dict",
              "set_optimizer_state_dict", "get_state_dict", "set_state_dict", "full_tensor", "model",
              "model.state_dict", "model.generate", "evaluate", "save_checkpoint", "load_checkpoint",
              "modeling.generate_replies", "metrics.stop_if_nonfinite")


def is_rank_zero_test(test):
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "rank"
            and isinstance(test.ops[0], ast.Eq) and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value == 0)


@pytest.mark.parametrize("script", TRAINING_SCRIPTS)
def test_no_collective_inside_a_rank_zero_branch(script):
    """A collective that only rank 0 reaches waits for the other ranks forever: the classic distributed hang."""
    tree = ast.parse((REPO / script).read_text())
    branches = [node for node in ast.walk(tree) if isinstance(node, ast.If) and is_rank_zero_test(node.test)]
    assert len(branches) >= 5  # the checkpoint writes, the logging, the progress bar, the summary
    for branch in branches:
        for call in calls(ast.Module(body=branch.body, type_ignores=[])):
            name = call_name(call)
            assert not (name.startswith(COLLECTIVE[:2]) or name in COLLECTIVE or name.endswith(".full_tensor")), \
                f"{script}:{call.lineno}: {name}() inside `if rank == 0:`"


def test_no_method_is_replaced_at_run_time():
    """`obj.forward = ...` hides what model(...) does: a model whose forward returns the loss is a class that says so,
    a pipeline stage a module built for its layers, precision a visible `with autocast:` block (tests may patch)."""
    for path in SOURCES:
        if path.relative_to(REPO).parts[0] == "tests":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else []
            assert not any(isinstance(target, ast.Attribute) and target.attr == "forward" for target in targets), \
                f"{path.name}:{node.lineno}: a forward replaced at run time"


# The shared modules and what each may import; scripts and tools import shared modules only. A module not listed
# here cannot be imported by anyone but a test or a benchmark.
SHARED_IMPORTS = {"common": set(), "modeling": {"common"}, "metrics": {"common"}, "tasks": {"common"},
                  "grading": {"common", "data"},
                  "prepare_data": {"common", "data", "tasks"}, "data": {"common"},
                  "checkpoints": {"common"}, "loading": {"checkpoints", "common", "modeling"}}
TOOLS = ["generate.py", "export_hf.py", "evaluate.py", "plot.py"]
TOP_LEVEL = sorted(p for p in REPO.glob("*.py"))


@pytest.mark.parametrize("module", sorted(SHARED_IMPORTS))
def test_no_shared_module_branches_on_the_stage(module):
    """What only one stage needs lives in its script, or is a parameter the script passes: no shared module reads a
    `stage` (args.stage, a stage argument) to decide what to do."""
    for node in ast.walk(ast.parse((REPO / f"{module}.py").read_text())):
        name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else \
            node.arg if isinstance(node, ast.arg) else None
        assert name != "stage", f"{module}.py:{node.lineno}: reads a stage"


SCRIPT_NAMES = [script.removesuffix(".py") for script in TRAINING_SCRIPTS]


@pytest.mark.parametrize("module", sorted(SHARED_IMPORTS))
def test_no_shared_module_names_a_script(module):
    """What a script's checkpoints are is said by the script (the scripts that resume them, whether its model knows the
    chat format) or by their files (the layout): no shared module's code or docstrings (its own docstring's example
    commands aside) hold a training script's name, a constant listing scripts, or a test of which script wrote a
    checkpoint (meta["script"] compared or looked up)."""
    tree = ast.parse((REPO / f"{module}.py").read_text())
    examples = tree.body[0].value if tree.body and isinstance(tree.body[0], ast.Expr) else None
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node is not examples:
            assert not any(name in node.value for name in SCRIPT_NAMES), f"{module}.py:{node.lineno}: names a script"
        if isinstance(node, ast.Name) and node.id.isupper():
            assert "SCRIPT" not in node.id, f"{module}.py:{node.lineno}: {node.id} lists scripts"
        if isinstance(node, ast.Compare):
            for operand in [node.left, *node.comparators]:
                is_writer = (isinstance(operand, ast.Subscript) and isinstance(operand.slice, ast.Constant)
                             and operand.slice.value == "script")
                assert not is_writer, f"{module}.py:{node.lineno}: decides by the script that wrote a checkpoint"


def project_imports(path):
    """The project's modules that PATH imports anywhere in it: at the top, or lazily inside a function."""
    modules = {p.stem for p in TOP_LEVEL}
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            imported.add(node.module.split(".")[0])
    return imported & modules


def test_imports_run_one_way_with_no_cycle():
    graph = {path.stem: project_imports(path) for path in TOP_LEVEL}
    assert set(SHARED_IMPORTS) <= set(graph)
    for module, allowed in SHARED_IMPORTS.items():
        assert graph[module] <= allowed, f"{module}.py imports {sorted(graph[module] - allowed)}"
    for script in [*TRAINING_SCRIPTS, *TOOLS]:
        stem = script.removesuffix(".py")
        assert graph[stem] <= set(SHARED_IMPORTS), f"{script} imports {sorted(graph[stem] - set(SHARED_IMPORTS))}"
    # The training scripts read prepared folders only (preparing a corpus, and generating the built-in task sets, is
    # prepare_data.py's) and load their checkpoints in their strategy's way (loading.py is the tools').
    for script in TRAINING_SCRIPTS:
        reached, todo = set(), [script.removesuffix(".py")]
        while todo:
            module = todo.pop()
            todo += sorted(graph[module] - reached)
            reached |= graph[module]
        preparing = reached & {"prepare_data", "tasks", "loading"}
        assert not preparing, f"{script} reaches {sorted(preparing)}"
    # pipeline.py runs the others: the training scripts as commands, evaluate.py and plot.py as modules; none imports it
    assert graph["pipeline"] <= {*SHARED_IMPORTS, "evaluate", "plot"}
    assert not any("pipeline" in imported for imported in graph.values())

    def visit(module, path):  # depth first: meeting a module already on the path is a cycle
        assert module not in path, f"import cycle: {' -> '.join([*path, module])}"
        for imported in graph[module]:
            visit(imported, [*path, module])

    for module in graph:
        visit(module, [])


HIDDEN_IMPORTS = {"importlib.import_module", "__import__", "exec", "runpy.run_path", "runpy.run_module"}


def hidden_loads(source):
    """The calls in `source` that load code out of an import's sight: importlib, __import__, exec, runpy, or a
    subprocess given a .py file to run."""
    found = []
    for call in calls(ast.parse(source)):
        texts = [node.value for node in ast.walk(call) if isinstance(node, ast.Constant)]
        runs_a_file = call_name(call).startswith(("subprocess.", "os.system", "os.exec")) and any(
            isinstance(text, str) and text.endswith(".py") for text in texts)
        if call_name(call) in HIDDEN_IMPORTS or runs_a_file:
            found.append(f"{call.lineno}: {call_name(call)}")
    return found


@pytest.mark.parametrize("name", [*TRAINING_SCRIPTS, *(f"{module}.py" for module in SHARED_IMPORTS)])
def test_no_project_code_is_loaded_out_of_the_readers_sight(name):
    """The reader's path (../shared/tools/reader_path.py) follows imports: no training script or shared module loads
    code another way."""
    assert not hidden_loads((REPO / name).read_text()), name


def test_the_hidden_load_check_sees_each_way():
    source = ("import importlib, subprocess\nimportlib.import_module('data')\n__import__('data')\n"
              "subprocess.run(['python', 'data.py'])\nsubprocess.run(['ls'])\n")
    assert hidden_loads(source) == ["2: importlib.import_module", "3: __import__", "4: subprocess.run"]


def test_the_import_check_sees_lazy_imports(tmp_path):
    lazy = tmp_path / "lazy.py"
    lazy.write_text("import os\n\n\ndef f():\n    import data\n    from checkpoints import read_meta\n")
    assert project_imports(lazy) == {"data", "checkpoints"}


@pytest.mark.parametrize("module", sorted(SHARED_IMPORTS))
def test_each_shared_module_is_at_most_500_lines(module):
    lines = len((REPO / f"{module}.py").read_text().splitlines())
    print(f"{module}.py: {lines} lines")
    assert lines <= 500


def test_no_line_of_the_projects_python_is_over_120_columns():
    long = [f"{path.relative_to(REPO)}:{number}" for path in SOURCES
            for number, line in enumerate(path.read_text().splitlines(), 1) if len(line) > 120]
    assert not long, f"{len(long)} lines over 120 columns: {', '.join(long[:10])}"


def test_ruff_finds_nothing():
    """pyproject.toml's rules: pycodestyle, pyflakes and import order, lines of at most 120 columns."""
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=REPO, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("document, limit", [("README.md", 16_500), ("BENCHMARKS.md", 20_000)])
def test_the_documents_stay_within_their_size(document, limit):
    """README is read first; BENCHMARKS keeps the latest GPU run and the one before (older ones: git history)."""
    size = (REPO / document).stat().st_size
    assert size <= limit, f"{document} is {size:,} bytes, over {limit:,}: move the detail to docs/ or to git"
