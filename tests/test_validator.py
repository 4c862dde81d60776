"""The validator has no holes: every plan key has a checked domain, any set of overrides ends in a valid plan
or a listing of problems (never another exception), and the inputs a run reads (agent module, data files,
checkpoints) are checked before anything starts. No Ray, no model."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from molt.plan import CONF_DIR
from molt.placement import layout
from molt.plan import Plan, PlanError, to_plan
from molt.validate import CHOICES, RANGES, check_inputs, validate
from runs import compose_plan

ROOT = Path(__file__).resolve().parent.parent
# Keys checked by a rule of their own in validate() rather than by CHOICES or RANGES.
PAIRS = {"estimator.reward_clip", "trainer.betas", "loss.importance_sampling.seq_gate"}
# Free text: names, paths and addresses (the paths are check_inputs' business).
FREE_TEXT = {"model.name", "model.path", "parallel.name", "rollout.cpu_omp_threads_bind", "agent.name", "agent.path",
             "data.name", "data.train_path", "data.eval_path", "schedule.name",
             "reference.path", "checkpoint.dir", "logger.mlflow.tracking_uri", "logger.mlflow.experiment",
             "logger.mlflow.run_name", "ray_address", "recipe"}


def plan_keys(cls=Plan, prefix="") -> dict[str, type]:
    """Every leaf key of the plan with its type, e.g. {"trainer.lr": float, "model.tiny": Optional[str]}."""
    keys = {}
    for name, kind in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(kind):
            keys |= plan_keys(kind, f"{prefix}{name}.")
        else:
            keys[prefix + name] = kind
    return keys


def base_type(kind) -> type:
    """int for int and Optional[int]; list for list[float]; and so on."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) is typing.Union:
        return base_type(args[0])
    return typing.get_origin(kind) or kind


KEYS = plan_keys()


def test_every_numeric_and_choice_key_has_a_checked_domain():
    for key, kind in KEYS.items():
        if base_type(kind) in (int, float):
            assert key in RANGES, f"{key} is a number without a range in molt/validate.py RANGES"
        elif base_type(kind) is str:
            assert key in CHOICES or key in FREE_TEXT, f"{key}: add its choices to CHOICES, or to FREE_TEXT here"
        elif base_type(kind) is list:
            assert key in PAIRS, f"{key}: a list nobody checks"
    assert set(RANGES) | set(CHOICES) <= set(KEYS), "a table names a key the plan does not have"


def test_ranges_do_not_reject_the_defaults():
    assert validate(Plan()) == []  # the dataclass defaults, without any YAML


# Neighbouring values per type: in range, at the edges, negative, zero, huge, NaN and infinities, empty and
# malformed lists, unknown choices. WRONG_TYPE values are refused by the schema (tested in test_config.py too).
NAN, INF = float("nan"), float("inf")
VALUES = {
    int: [-1, 0, 1, 2, 3, 8, 10**12],
    float: [-1.0, 0.0, 1e-9, 0.5, 1.0, 1.5, 1e30, NAN, INF, -INF],
    bool: [True, False],
    str: ["bogus", "", "1"],
    list: [[], [1.0], [0.5, 2.0], [2.0, 0.5], [1.0, 2.0, 3.0], [0.9, 0.999], [NAN, 1.0]],
    dict: [{}],
}
WRONG_TYPE = {int: ["abc", 1.5], float: ["abc"], bool: ["maybe"], list: ["abc"]}
INPUT_KEYS = ("agent.path", "data.train_path", "data.eval_path", "model.path", "reference.path")


def values_for(key: str, inputs: dict[str, list[str]]) -> list:
    kind = KEYS[key]
    optional = type(None) in typing.get_args(kind)
    return VALUES[base_type(kind)] + list(CHOICES.get(key, ())) + inputs.get(key, []) + [None] * optional


def override(key: str, value) -> str:
    """`key=value` in Hydra's override syntax."""
    def text(v):
        if v is None:
            return "null"
        if isinstance(v, bool):
            return str(v).lower()
        if isinstance(v, list):
            return "[" + ",".join(text(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{}"
        return repr(v) if v == "" else str(v)  # nan, inf and -inf read back as floats
    return f"{key}={text(value)}"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, list[str]]:
    """Real files for the path keys: one good and a few bad of each."""
    root = tmp_path_factory.mktemp("inputs")
    (root / "good.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "2+2?"}]}) + "\n")
    (root / "bad.jsonl").write_text('{"prompt": "2+2?"}\nnot json\n')
    (root / "empty.jsonl").write_text("")
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text("{}")
    data = [str(root / n) for n in ("good.jsonl", "bad.jsonl", "empty.jsonl", "missing.jsonl")] + [str(root)]
    return {
        "agent.path": ["molt.agents.arithmetic", "molt.agents.openai_chat", "no.such.module", "os",
                       str(ROOT / "tests" / "faulty_agent.py"), str(root / "missing.py")],
        "data.train_path": data,
        "data.eval_path": data,
        "model.path": [str(root / "model"), str(root), str(root / "missing")],
        "reference.path": [str(root / "model"), str(root)],
    }


def check_listing(plan: Plan) -> None:
    """validate + check_inputs give messages naming plan keys; a plan with none can be laid out and micro-batched."""
    problems = validate(plan) + check_inputs(plan)
    assert all(isinstance(p, str) and any(key in p for key in KEYS) for p in problems), problems
    if not problems:
        layout(plan)
        assert plan.rollouts_per_step % (plan.trainer.micro_batch_size * plan.actor_dp_size) == 0


def test_each_key_at_each_neighbouring_value_gives_a_plan_or_a_listing(inputs):
    """Every key alone at every value of its type's pool, on the default plan (to_plan on the composed dict,
    which is what Hydra hands to molt-run)."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        base = OmegaConf.to_container(compose(config_name="config"))
    for key in KEYS:
        for value in values_for(key, inputs) + WRONG_TYPE.get(base_type(KEYS[key]), []):
            cfg = copy.deepcopy(base)
            *path, leaf = key.split(".")
            node = cfg
            for part in path:
                node = node[part]
            node[leaf] = value
            try:
                plan = to_plan(cfg)
            except PlanError as e:
                assert f"config key '{key}'" in str(e), (key, value, e)
                continue
            check_listing(plan)


# Every group under conf/ with its options (conf/experiment links to experiments/).
GROUPS = {d.name: sorted(p.stem for p in d.glob("*.yaml")) for d in sorted(Path(CONF_DIR).iterdir()) if d.is_dir()}
UNKNOWN_KEYS = ["+bogus.key=1", "+trainer.nope=2", "trainer.nope=2", "+model.num_experts=8"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(
    groups=st.lists(st.sampled_from(sorted(GROUPS)), unique=True),
    keys=st.lists(st.sampled_from(sorted(KEYS)), max_size=8, unique=True),
    wrong_type=st.booleans(),
    unknown=st.lists(st.sampled_from(UNKNOWN_KEYS), max_size=1),
    data=st.data(),
)
def test_any_groups_and_overrides_give_a_plan_or_a_listing_never_an_exception(inputs, groups, keys, wrong_type,
                                                                                 unknown, data):
    """Any options of any groups plus any overrides (values from each key's pool, at most one of a wrong type,
    maybe an unknown key), through Hydra's compose as molt-run gets them: combinations the sweep above misses.
    The outcome is an error naming one of the keys or groups set, or a plan that check_listing accepts."""
    args = [f"{group}={data.draw(st.sampled_from(GROUPS[group]), label=group)}" for group in groups]
    values = {key: data.draw(st.sampled_from(values_for(key, inputs)), label=key) for key in keys}
    wrong = WRONG_TYPE.get(base_type(KEYS[keys[0]])) if keys else None
    if wrong_type and wrong:  # at most one, or nearly every set would stop at the schema
        values[keys[0]] = data.draw(st.sampled_from(wrong), label="wrong type")
    args += [override(key, value) for key, value in values.items()] + unknown
    named = {arg.split("=")[0].lstrip("+") for arg in args}
    try:
        plan = compose_plan(*args)
    except PlanError as e:
        [key] = re.findall(r"config key '([^']+)'", str(e))
        assert any(name == key or name.startswith(key + ".") for name in named), (args, e)
        return
    except (HydraException, OmegaConfBaseException) as e:  # Hydra refuses an override while composing
        message = str(e) + str(e.__cause__ or "")
        assert any(name in message for name in named), (args, message)
        return
    check_listing(plan)


# ---- check_inputs ----------------------------------------------------------------------------------------

def test_inputs_of_the_default_plan_pass():
    assert check_inputs(compose_plan()) == []


def test_a_missing_or_wrong_agent_module_is_named():
    [problem] = check_inputs(compose_plan("agent.path=no.such.module"))
    assert problem.startswith("agent.path=no.such.module") and "ModuleNotFoundError" in problem
    [problem] = check_inputs(compose_plan("agent.form=chat"))  # arithmetic's AgentRunner is an Env
    assert "agent.path=molt.agents.arithmetic" in problem and "agent.form=env" in problem
    [problem] = check_inputs(compose_plan("agent.path=os"))
    assert "AgentRunner" in problem


def test_a_module_without_a_dataset_needs_a_data_file(tmp_path):
    module = tmp_path / "nodata.py"
    module.write_text("from molt.agent import Env\n\nclass AgentRunner(Env):\n    pass\n")
    [problem] = check_inputs(compose_plan(f"agent.path={module}"))
    assert "data.train_path is not set" in problem
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert check_inputs(compose_plan(f"agent.path={module}", f"data.train_path={rows}")) == []
    [problem] = check_inputs(compose_plan(f"agent.path={module}", f"data.train_path={rows}", "logger.eval_every=5"))
    assert "data.eval_path is not set" in problem


def test_data_files_must_exist_and_start_with_chat_rows(tmp_path):
    [problem] = check_inputs(compose_plan("data.train_path=/missing.jsonl"))
    assert problem.startswith("data.train_path=/missing.jsonl") and "No such file" in problem
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}]})
    bad = tmp_path / "bad.jsonl"
    bad.write_text(good + "\n" + json.dumps({"messages": [{"role": "robot", "content": "hi"}]}) + "\n")
    [problem] = check_inputs(compose_plan(f"data.eval_path={bad}"))
    assert problem.startswith("data.eval_path=") and "row 2" in problem and "data.bad_rows=skip" in problem
    assert check_inputs(compose_plan(f"data.eval_path={bad}", "data.bad_rows=skip")) == []  # row 1 is usable
    all_bad = tmp_path / "all_bad.jsonl"
    all_bad.write_text("[1, 2]\n")
    [problem] = check_inputs(compose_plan(f"data.train_path={all_bad}", "data.bad_rows=skip"))
    assert "row 1" in problem


def test_a_user_checkpoint_needs_its_config(tmp_path):
    [problem] = check_inputs(compose_plan("model=qwen3_4b", f"model.path={tmp_path}"))
    assert problem.startswith(f"model.path={tmp_path}") and "config.json" in problem
    (tmp_path / "config.json").write_text("{}")
    assert check_inputs(compose_plan("model=qwen3_4b", f"model.path={tmp_path}")) == []
    assert check_inputs(compose_plan(f"model.path={tmp_path / 'nowhere'}")) == []  # a tiny model is built there
    [problem] = check_inputs(compose_plan("reference.enabled=true", "reference.path=/no/teacher"))
    assert problem.startswith("reference.path=/no/teacher")


def test_expert_parallel_must_divide_the_checkpoints_experts(tmp_path):
    """The experts per layer are the checkpoint's (config.json, or its text_config for a multimodal model)."""
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"num_experts": 6}}))
    moe = ["model=qwen35b_moe", f"model.path={tmp_path}", "parallel=fsdp8"]
    [problem] = check_inputs(compose_plan(*moe, "parallel.ep_size=4"))
    assert problem.startswith("parallel.ep_size=4 does not divide the 6 experts") and "model.path" in problem
    assert check_inputs(compose_plan(*moe, "parallel.ep_size=2")) == []
    (tmp_path / "config.json").write_text(json.dumps({"n_routed_experts": 8}))
    assert check_inputs(compose_plan(*moe, "parallel.ep_size=4")) == []
    [problem] = check_inputs(compose_plan(*moe, "parallel.ep_size=3"))
    assert "the 8 experts" in problem


# ---- molt-run, as a new user runs it ---------------------------------------------------------------------

ISSUE_EXAMPLES = ["trainer.lr=-1", "trainer.steps=-3", "loss.clip_low=1.5", "estimator.eps=0",
                  "trainer.micro_batch_size=0", "agent.path=no.such.module", "data.train_path=/missing.jsonl"]


@pytest.mark.parametrize("override", ISSUE_EXAMPLES)
def test_dry_run_refuses_the_issue_examples_naming_the_key_without_a_traceback(override, tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", "from molt.cli import run; run()", override, "dry_run=true",
         f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output
    assert f"  - {override.split('=')[0]}=" in result.stderr, result.stderr
