"""Safe executor vs bfcl-eval's eval-based executor (the reference oracle, used only here)."""

from __future__ import annotations

import ast
import copy
import itertools
import os
import re
import threading

import pytest
from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils as mtu
from bfcl_eval.eval_checker.multi_turn_eval.func_source_code import long_context as lc_module

from env_service.bfcl import upstream  # noqa: F401  (sets BFCL_PROJECT_ROOT before bfcl_eval is imported)
from env_service.bfcl.calls import ToolCall, format_call_string, parse_call_string, tool_parameter_names
from env_service.bfcl.executor import BackendSession, ToolNotAvailable
from env_service.bfcl.tasks import all_task_ids, load_task

_names = itertools.count()
EXT_CARD = "1234567812345678"  # a long-context TravelAPI extension card (module-level dict in bfcl)
LOWER_BUDGET = "set_budget_limit(access_token='abc123token', budget_limit=100.0)"  # else booking refused


def _unique_model_name() -> str:
    return f"seal_test_exec_{os.getpid()}_{next(_names)}"


def _cleanup(model_name: str) -> None:
    prefix = re.sub(r"[-./:]", "_", model_name)
    for key in [k for k in vars(mtu) if k.startswith(prefix)]:
        del vars(mtu)[key]


def _snapshot_long_context_module():
    return {
        k: copy.deepcopy(v) for k, v in vars(lc_module).items() if isinstance(v, (dict, list)) and not k.startswith("_")
    }


def _restore_long_context_module(snapshot) -> None:
    # Restore in place: the backend modules hold references to these very objects.
    for name, saved in snapshot.items():
        current = vars(lc_module)[name]
        if isinstance(current, dict):
            current.clear()
            current.update(copy.deepcopy(saved))
        else:
            current[:] = copy.deepcopy(saved)


class BfclRunner:
    """Runs call strings through bfcl's execute_multi_turn_func_call under one fresh namespace."""

    def __init__(self, task):
        self.task = task
        self.model_name = _unique_model_name()

    def run(self, call_strings: list[str]) -> list[str]:
        results, self.instances = mtu.execute_multi_turn_func_call(
            call_strings,
            copy.deepcopy(self.task.initial_config),
            self.task.involved_classes,
            self.model_name,
            self.task.id,
            long_context=self.task.long_context,
            is_evaL_run=False,
        )
        return results

    def close(self) -> None:
        _cleanup(self.model_name)


@pytest.fixture
def restore_bfcl_modules():
    snapshot = _snapshot_long_context_module()
    yield
    _restore_long_context_module(snapshot)


def _bfcl_single(task, call: ToolCall | str, prefix_calls: list[str] = ()) -> str:
    runner = BfclRunner(task)
    try:
        if prefix_calls:
            runner.run(list(prefix_calls))
        return runner.run([call if isinstance(call, str) else format_call_string(call)])[0]
    finally:
        runner.close()


# -- the full differential ------------------------------------------------------------------------


def test_every_ground_truth_call_matches_bfcl(restore_bfcl_modules):
    checked = 0
    for task_id in all_task_ids():
        task = load_task(task_id)
        runner = BfclRunner(task)
        session = BackendSession(task)
        try:
            for turn in task.ground_truth:
                reference = runner.run(turn)  # bfcl executes the original strings (positional args too)
                ours = [session.execute(parse_call_string(s, task)) for s in turn]
                assert ours == reference, (task_id, turn)
                checked += len(turn)
        finally:
            runner.close()
            session.close()
    assert checked == 4625
    assert not [k for k in vars(mtu) if k.startswith("seal_test_exec_")]  # registry cleaned


def test_tool_names_match_bfcl_method_mapping():
    for task_id in ("multi_turn_base_0", "multi_turn_long_context_150", "multi_turn_miss_func_7"):
        task = load_task(task_id)
        runner = BfclRunner(task)
        try:
            runner.run([])
            expected = {
                name
                for instance in runner.instances.values()
                for name in dir(instance)
                if not name.startswith("_") and callable(getattr(instance, name))
            }
        finally:
            runner.close()
        assert BackendSession(task).tool_names == expected


# -- isolation ------------------------------------------------------------------------------------


def _book_with_extension_card() -> ToolCall:
    return ToolCall(
        "book_flight",
        {
            "access_token": "abc123token",
            "card_id": EXT_CARD,
            "travel_date": "2024-12-01",
            "travel_from": "SFO",
            "travel_to": "LAX",
            "travel_class": "economy",
        },
    )


def test_travel_long_context_credit_card_leak_exists_in_bfcl(restore_bfcl_modules):
    task = load_task("multi_turn_long_context_150")
    original = lc_module.CREDIT_CARD_EXTENSION[EXT_CARD]["balance"]
    first, second = BfclRunner(task), BfclRunner(task)
    try:
        result = first.run([LOWER_BUDGET, format_call_string(_book_with_extension_card())])[1]
        assert '"booking_status": true' in result
        second.run([])  # a brand-new episode in bfcl
        leaked = second.instances["TravelAPI"].credit_card_list[EXT_CARD]["balance"]
    finally:
        first.close()
        second.close()
    assert leaked < original  # the new episode starts with the previous episode's spending
    assert lc_module.CREDIT_CARD_EXTENSION[EXT_CARD]["balance"] == leaked


def test_sessions_are_isolated_including_module_state():
    task = load_task("multi_turn_long_context_150")
    original = lc_module.CREDIT_CARD_EXTENSION[EXT_CARD]["balance"]
    first = BackendSession(task)
    first.execute(parse_call_string(LOWER_BUDGET, task))
    assert '"booking_status": true' in first.execute(_book_with_extension_card())
    assert first.instances["TravelAPI"].credit_card_list[EXT_CARD]["balance"] < original
    second = BackendSession(task)
    assert second.instances["TravelAPI"].credit_card_list[EXT_CARD]["balance"] == original
    assert lc_module.CREDIT_CARD_EXTENSION[EXT_CARD]["balance"] == original
    # ordinary state is per session too
    fs_task = load_task("multi_turn_base_0")
    a, b = BackendSession(fs_task), BackendSession(fs_task)
    assert "Error" not in a.execute(ToolCall("mkdir", {"dir_name": "only_in_a"}))
    assert "only_in_a" in a.execute(ToolCall("ls", {}))
    assert "only_in_a" not in b.execute(ToolCall("ls", {}))


def test_arguments_are_not_aliased_into_backend_state():
    task = load_task("multi_turn_base_0")  # TwitterAPI with user analyst_pro
    session = BackendSession(task)
    password = task.initial_config["TwitterAPI"]["password"]
    login = session.execute(ToolCall("authenticate_twitter", {"username": "analyst_pro", "password": password}))
    assert login == '{"authentication_status": true}'
    tags = ["#a"]
    assert '"tags": ["#a"]' in session.execute(ToolCall("post_tweet", {"content": "hi", "tags": tags}))
    tags.append("#mutated")  # a caller reusing its argument objects must not reach backend state
    assert list(session.instances["TwitterAPI"].tweets.values())[-1]["tags"] == ["#a"]


def test_threads_give_sequential_results():
    task = load_task("multi_turn_long_context_0")
    calls = [parse_call_string(s, task) for turn in task.ground_truth for s in turn]

    def run_all() -> list[str]:
        session = BackendSession(task)
        return [session.execute(call) for call in calls]

    expected = run_all()
    outputs: list[list[str]] = []
    threads = [threading.Thread(target=lambda: outputs.append(run_all())) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outputs == [expected] * 4


# -- error strings identical to bfcl ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["kill", "exit", "quit", "remove", "unlink", "popen", "Popen", "run", "os.kill"])
def test_deny_list_matches_bfcl(name):
    task = load_task("multi_turn_base_0")
    call = ToolCall(name, {"pid": 1})
    ours = BackendSession(task).execute(call)
    assert ours == f"Error during execution: Function call {name.split('.')[-1]} is not allowed."
    assert ours == _bfcl_single(task, call)


@pytest.mark.parametrize(
    "call",
    [
        ToolCall("no_such_tool", {"a": 1}),
        ToolCall("authenticate_travel", {}),  # a real tool, but not of this task's classes
        ToolCall("ls", {"unknown_flag": True}),
        ToolCall("cd", {}),
        ToolCall("cd", {"folder": 3}),
        ToolCall("mean", {"numbers": []}),
        ToolCall("cd", {"folder": float("nan")}),
        ToolCall("mean", {"numbers": [1.0, float("-inf"), float("nan")]}),
        ToolCall("cd", {"file name": "x"}),
        ToolCall("cd", {"from": "x"}),
        ToolCall("cd", {"None": "x"}),
        ToolCall("cd", {"1folder": "x"}),
        ToolCall("cd", {"": "x"}),
        ToolCall("cat", {"ﬁle_name": "a", "file_name": "b"}),  # repeated after normalisation
        ToolCall("", {"x": 1}),
        ToolCall("a.b", {}),
        ToolCall("class", {}),
        ToolCall("not valid", {}),
        ToolCall("x or y", {}),
        ToolCall("a[0]", {"k": 1}),
    ],
    ids=lambda c: f"{c.name}-{list(c.arguments)}",
)
def test_error_strings_match_bfcl(call):
    task = _task_with("MathAPI") if call.name == "mean" else load_task("multi_turn_base_0")
    ours = BackendSession(task).execute(call)
    assert ours == _bfcl_single(task, call)
    assert ours.startswith(("Error during execution: ", '{"error": '))


def _task_with(class_name: str):
    return next(t for t in map(load_task, all_task_ids("base")) if class_name in t.involved_classes)


def test_non_ascii_argument_names_are_normalised_like_python():
    task = load_task("multi_turn_base_0")
    call = ToolCall("cat", {"\ufb01le_name": "notes"})  # the "fi" ligature: NFKC gives file_name
    ours = BackendSession(task).execute(call)
    assert ours == _bfcl_single(task, call)
    assert "No such file" in ours  # the call really ran with file_name


def test_result_conversion_matches_bfcl_for_str_dict_and_other():
    task = _task_with("MathAPI")
    session = BackendSession(task)
    calls = [ToolCall("mean", {"numbers": [1, 2]}), ToolCall("add", {"a": 1, "b": 2})]
    for name in sorted(session.tool_names)[:6]:
        calls.append(ToolCall(name, {}))
    for call in calls:
        assert session.execute(call) == _bfcl_single(task, call), call


def test_hostile_names_and_arguments_never_run(tmp_path):
    task = load_task("multi_turn_base_0")
    session = BackendSession(task)
    marker = tmp_path / "pwned"
    hostile_names = [
        f"(lambda: open({str(marker)!r}, 'w'))",
        f"open({str(marker)!r}, 'w').close",
        "__import__('os').getpid",
        "print",
        "exec",
        "eval",
    ]
    for name in hostile_names:
        result = session.execute(ToolCall(name, {}))
        assert result.startswith("Error during execution: "), name
    hostile_keys = {f"x=open({str(marker)!r}, 'w'),y": 1}
    result = session.execute(ToolCall("ls", hostile_keys))
    assert result.startswith("Error during execution: invalid argument name")
    before = session.execute(ToolCall("ls", {}))
    for value in ({1, 2}, (1, 2), object(), lambda: None, b"bytes", {1: "int key"}, [ValueError]):
        result = session.execute(ToolCall("mkdir", {"dir_name": value}))
        assert result.startswith("Error during execution: ") and "JSON" in result, value
    assert session.execute(ToolCall("ls", {})) == before  # nothing ran
    assert session.execute(ToolCall(123, {})).startswith("Error during execution: ")  # type: ignore[arg-type]
    assert session.execute(ToolCall("ls", [1])).startswith("Error during execution: ")  # type: ignore[arg-type]
    assert not marker.exists()


def test_allowed_restricts_known_tools_only():
    task = load_task("multi_turn_base_0")
    session = BackendSession(task, allowed={"ls", "pwd"})
    assert not session.execute(ToolCall("ls", {})).startswith("Error")
    with pytest.raises(ToolNotAvailable) as info:
        session.execute(ToolCall("cd", {"folder": "document"}))
    assert info.value.name == "cd" and "not available" in str(info.value)
    assert session.execute(ToolCall("nope", {})) == "Error during execution: name 'nope' is not defined"
    session.allowed = None  # the episode may widen the set as tools are revealed
    assert session.execute(ToolCall("cd", {"folder": "document"})) != ""


def test_close_drops_instances():
    session = BackendSession(load_task("multi_turn_base_0"))
    session.close()
    assert session.closed
    with pytest.raises(RuntimeError, match="closed"):
        session.execute(ToolCall("ls", {}))


# -- the string-literal rewrite divergence ----------------------------------------------------------


def test_bfcl_rewrites_method_names_inside_strings_but_we_do_not():
    """bfcl's regex turns ``ls(`` inside a string argument into ``<registry name>.ls(``."""
    task = load_task("multi_turn_base_0")
    calls = [
        "touch(file_name='note.txt')",
        "echo(content='please run ls( now', file_name='note.txt')",
        "cat(file_name='note.txt')",
    ]
    runner = BfclRunner(task)
    try:
        reference = runner.run(calls)
    finally:
        runner.close()
    session = BackendSession(task)
    ours = [session.execute(parse_call_string(s, task)) for s in calls]
    assert "_GorillaFileSystem_instance.ls(" in reference[2]
    assert ours[2] == '{"file_content": "please run ls( now"}'
    assert ours[:2] == reference[:2]


def test_no_ground_truth_call_is_affected_by_the_rewrite():
    pattern = re.compile(r"\b([a-zA-Z_]\w*)\s*(?=\()")
    for task_id in all_task_ids():
        task = load_task(task_id)
        names = BackendSession(task).tool_names
        for turn in task.ground_truth:
            for s in turn:
                for node in ast.walk(ast.parse(s, mode="eval")):
                    if isinstance(node, ast.Constant) and isinstance(node.value, str):
                        assert not any(m in names for m in pattern.findall(node.value)), (task_id, s)


# -- parsing and formatting -----------------------------------------------------------------------


def test_parse_call_string_maps_positional_arguments():
    task = load_task("multi_turn_base_0")
    call = parse_call_string("sort('final_report.pdf')", task)
    assert call == ToolCall("sort", {"file_name": "final_report.pdf"})
    call = parse_call_string("grep(file_name='a', pattern='b')", task)
    assert call.arguments == {"file_name": "a", "pattern": "b"}
    assert parse_call_string("ls()", task) == ToolCall("ls", {})
    assert tool_parameter_names("cd", task.involved_classes) == ("folder",)
    vehicle = _task_with("VehicleControlAPI")
    assert parse_call_string("fillFuelTank(15.0)", vehicle).arguments == {"fuelAmount": 15.0}


@pytest.mark.parametrize(
    "bad",
    [
        "ls(",
        "a.b()",
        "ls(**{'a': 1})",
        "cd(folder=x)",
        "cd(folder=1+2)",
        "unknown_tool('x')",
        "ls(1, 2, 3)",
        "42",
        "cd(folder='a', folder='b')",
    ],
)
def test_parse_call_string_rejects(bad):
    with pytest.raises(ValueError):
        parse_call_string(bad, load_task("multi_turn_base_0"))


def test_format_call_string_is_bfcl_convert_to_function_call():
    # bfcl.model_handler.utils cannot be imported without tree_sitter; check its source instead.
    from pathlib import Path

    import bfcl_eval

    source = (Path(bfcl_eval.__file__).parent / "model_handler" / "utils.py").read_text()
    assert "f\"{key}({','.join([f'{k}={repr(v)}' for k,v in value.items()])})\"" in source
    call = ToolCall("post_tweet", {"content": 'it\'s "x"', "tags": ["#a", "#b"], "n": 1.5, "ok": True, "none": None})
    expected = "post_tweet(content='it\\'s \"x\"',tags=['#a', '#b'],n=1.5,ok=True,none=None)"
    assert format_call_string(call) == expected
    assert format_call_string(ToolCall("ls", {})) == "ls()"
    assert format_call_string(ToolCall("cd", {"folder": "a", "x": 2})) == "cd(folder='a',x=2)"


def test_production_code_never_evals():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "env_service" / "bfcl"
    forbidden = {"eval", "exec", "compile", "__import__", "execute_multi_turn_func_call"}
    for name in ("upstream.py", "tasks.py", "calls.py", "executor.py", "verifier.py"):
        source = (root / name).read_text()
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Name):
                assert func.id not in forbidden, (name, func.id)
            elif isinstance(func, ast.Attribute) and func.attr in forbidden:
                # re.compile builds a regex; anything else named like this is suspicious
                assert func.attr == "compile" and isinstance(func.value, ast.Name) and func.value.id == "re", (
                    name,
                    func.attr,
                )


def test_costly_math_arguments_are_refused_before_they_stall_the_service():
    import time

    from env_service.bfcl.calls import ToolCall
    from env_service.bfcl.executor import BackendSession
    from env_service.bfcl.tasks import all_task_ids, load_task

    math_task = next(load_task(t) for t in all_task_ids() if "MathAPI" in load_task(t).involved_classes)
    with BackendSession(math_task) as session:
        start = time.monotonic()
        results = [
            session.execute(ToolCall("logarithm", {"value": 10, "base": 2, "precision": 10**9})),
            session.execute(ToolCall("square_root", {"number": 2, "precision": 10**9})),
            session.execute(ToolCall("power", {"base": 10, "exponent": 10**9})),
            # shapes that stalled bfcl's backends 15-150 s: a huge negative rounding, the precision as a
            # string (mpmath takes int() of it), a huge base below the exponent limit
            session.execute(ToolCall("round_number", {"number": 5, "decimal_places": -(10**9)})),
            session.execute(ToolCall("logarithm", {"value": 10, "base": 2, "precision": "100000000"})),
            session.execute(ToolCall("logarithm", {"value": 10, "base": 2, "precision": " 100000000 "})),
            session.execute(ToolCall("power", {"base": 10**4000, "exponent": 10000})),
            session.execute(ToolCall("power", {"base": -(10**4000), "exponent": 9999})),
        ]
        assert time.monotonic() - start < 1.0
        assert all(r.startswith("Error during execution:") and "limit" in r for r in results), results
        # ordinary values still compute exactly as bfcl does
        assert session.execute(ToolCall("power", {"base": 2, "exponent": 10})) == '{"result": 1024}'


def test_time_and_memory_budgets_stop_a_call_and_free_what_it_built():
    import time

    from env_service.bfcl.executor import CallOverBudget, resident_bytes, time_limit

    started = time.monotonic()
    with pytest.raises(CallOverBudget, match="0.2 s, its time budget"):
        with time_limit(0.2):
            while True:  # a backend's endless pure-Python loop
                pass
    assert time.monotonic() - started < 1.0
    with pytest.raises(CallOverBudget, match="more than 64 MiB of memory"):
        with time_limit(30, 64 * 2**20):
            hoard = []
            while True:
                hoard.append("x" * 1000 + str(len(hoard)))
    del hoard
    assert resident_bytes() > 0


def test_measured_bytes_counts_shared_objects_once_and_stops_at_its_limit():
    from env_service.sizes import measured_bytes

    shared = ["y" * 1000]
    assert 1000 < measured_bytes({"a": shared, "b": shared}, 10**6) < 2000
    cycle: list = []
    cycle.append(cycle)
    assert measured_bytes(cycle, 10**6) < 1000
    chain = None
    for _ in range(100_000):
        chain = [chain, "z" * 10]
    assert 10_000 < measured_bytes(chain, 10_000) < 10_200  # the walk stops right after the limit


def test_time_limit_gives_an_outer_alarm_back():
    """A test runner's (or any caller's) own SIGALRM timer keeps running across a budgeted call."""
    import signal
    import time

    from env_service.bfcl.executor import time_limit

    fired: list[float] = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(time.monotonic()))
    try:
        started = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, 0.6)
        with time_limit(5.0):
            time.sleep(0.1)
        assert 0.3 < signal.getitimer(signal.ITIMER_REAL)[0] <= 0.5
        time.sleep(1.0)
        assert fired and 0.5 < fired[0] - started < 1.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _spin_holding(box: list) -> None:
    junk = box.pop()  # now only this frame holds it: freed when the stopped call's frame is cleared (~0.1 s of C)
    while junk:
        pass


def test_a_stopped_call_that_takes_long_to_unwind_is_stopped_once():
    """The timer keeps ticking while a stopped call unwinds; a tick during the cleanup (here, freeing what the call
    built) must not interrupt the interruption. Before, the second tick escaped as a bare BaseException, and one that
    landed after the handler was restored killed the process with SIGALRM."""
    from env_service.bfcl.executor import CallOverBudget, time_limit

    box = [[[k] for k in range(2_000_000)]]
    with pytest.raises(CallOverBudget, match="its time budget"):
        with time_limit(0.05):
            _spin_holding(box)
