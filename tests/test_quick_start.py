"""The README's quick start runs as written, in order (issue 48).

The commands are read from the README's "Quick start" section (its ```bash blocks), so a
change there that stops them working fails here. Each ``$ms ...`` line runs through
``ms_efficient.cli.main`` in a temporary folder (the cwd: runs/, plans and bench.json go
there); ``a; b`` is two commands. Substitutions, the only ones made:

- configs/NAME.yaml that a ``train`` command names is written into the temporary folder as
  the repository's file with a tiny model, the tests' small corpus (conftest.write_corpus)
  and ``train.steps`` TINY_STEPS (its moe, efficientmoe and cluster sections as they are);
  the other configs are copied as they are. The commands keep the README's paths.
- ``--steps N`` keeps its meaning, the total the run trains to, against the tiny runs: a
  first ``train CONFIG --steps N`` becomes TINY_STEPS; on ``--resume DIR`` it becomes the
  test run's step reached + 1 when N is above the README run's (its config's train.steps or
  an earlier --steps), else a value at or below the test run's step reached, so a README
  resume that would train nothing is refused here as it is for a user.
- ``kind|kind|...`` (``bench moe|mpipe|...``) is one command per kind; ``my_net.mindir`` (the
  user's exported graph) is written by the test (a small MLP, ``mindspore.export``).
- the msrun line (``PATH=.venv/bin:$PATH msrun ... examples/moe_expert_parallel.py ...``)
  runs the repository's example (copied into the folder) with this interpreter's folder first
  on PATH, a free port for ``--master_port`` and ``--steps 2`` (its own option; 20 by
  default).

``train --workers W`` (W >= 2) commands, the commands reading their run folders and the msrun
line start msrun ranks: they run in tests/test_quick_start_ep.py, in child processes in the
background (tests/workers.py); ``bench`` in a test of its own. The rest runs in
``test_one_process_commands_run_as_written`` (about 30 CPU-s on 2 cores).
"""
import math
import os
import re
import shlex
import shutil
import subprocess
import sys

import numpy as np
import pytest
import yaml

import workers
from conftest import ROOT, write_corpus
from ms_efficient.cli import main

README = os.path.join(ROOT, "README.md")
TINY_STEPS = 2
TINY = {       # the shrunk sections of a training config (cf. conftest.tiny_config_dict)
    "model": {"seq_length": 32, "hidden_size": 32, "num_layers": 2, "num_heads": 2,
              "ffn_hidden_size": 64},
    "data": {"max_bytes": 200000, "val_fraction": 0.1},
    "train": {"steps": TINY_STEPS, "batch_size": 4, "warmup_steps": 1, "log_every": 1,
              "eval_every": TINY_STEPS, "eval_batches": 1, "save_every": TINY_STEPS},
}


# ------------------------------------------------------------------------ the README's text

def quick_start_blocks():
    """[(language, text)] of the code blocks of the README's "Quick start" section."""
    with open(README, encoding="utf-8") as fh:
        text = fh.read()
    assert "\n## Quick start\n" in text, "README.md has no '## Quick start' section"
    section = text.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(\w*)\n(.*?)```", section, re.S)


def shell_commands():
    """The quick start's shell commands in order: dicts of ``line`` (as written), ``env``
    (leading NAME=value assignments), ``argv`` (variables set by an earlier line, such as
    ``ms=...``, expanded), ``tool`` ("ms-efficient" or argv[0])."""
    variables, commands = {}, []
    for lang, body in quick_start_blocks():
        if lang not in ("bash", "sh", "shell"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=";")
            lexer.whitespace_split, lexer.commenters = True, "#"
            tokens, parts = list(lexer), [[]]
            for token in tokens:
                if token == ";":
                    parts.append([])
                else:
                    parts[-1].append(token)
            for part in filter(None, parts):
                env = {}
                while part and re.fullmatch(r"[A-Za-z_]\w*=\S*", part[0]):
                    name, value = part.pop(0).split("=", 1)
                    env[name] = value
                if not part:                       # ms=.venv/bin/ms-efficient
                    variables.update(env)
                    continue
                argv = [re.sub(r"\$(\w+)", lambda m: variables.get(m.group(1), m.group(0)), a)
                        for a in part]
                tool = os.path.basename(argv[0])
                commands.append({"line": line.strip(), "env": env, "argv": argv,
                                 "tool": tool})
    return commands


def _option(argv, name):
    return argv[argv.index(name) + 1] if name in argv else None


def _needs_msrun(commands):
    """Indices of the commands that start msrun ranks or read the run folder of one."""
    ep_folders, picked = set(), set()
    for i, cmd in enumerate(commands):
        argv = cmd["argv"]
        workers_n = _option(argv, "--workers")
        starts = cmd["tool"] == "msrun" or (workers_n is not None and int(workers_n) >= 2)
        reads = any(a.rstrip("/") == f or a.startswith(f + "/")
                    for a in argv[1:] for f in ep_folders)
        if starts or reads:
            picked.add(i)
        if starts and cmd["tool"] == "ms-efficient" and argv[1] == "train":
            ep_folders.add((_option(argv, "--out") or _option(argv, "--resume")).rstrip("/"))
    return picked


def test_the_quick_start_is_parsed_into_the_commands_it_shows():
    commands = shell_commands()
    tools = {c["tool"] for c in commands}
    assert tools == {"ms-efficient", "msrun"}, tools
    lines = [c["argv"][1:3] for c in commands if c["tool"] == "ms-efficient"]
    assert ["train", "--resume"] in lines and ["plan", "moe"] in lines
    msrun = [c for c in commands if c["tool"] == "msrun"]
    assert len(msrun) == 1 and "examples/moe_expert_parallel.py" in msrun[0]["argv"]
    assert msrun[0]["env"]["PATH"] == ".venv/bin:$PATH"
    # the script it launches is the repository's, and the command names the README's options
    assert os.path.isfile(os.path.join(ROOT, "examples", "moe_expert_parallel.py"))
    for option in ("--worker_num=2", "--local_worker_num=2", "--join=True"):
        assert option in msrun[0]["argv"], option


# ------------------------------------------------------------------------ running them

class QuickStart:
    """Runs the README's commands in ``cwd`` with the substitutions of the module docstring;
    ``runs``: run folder -> [README's step reached, the test run's step reached]."""

    def __init__(self, cwd, capsys=None):
        """capsys: pytest's, to run the commands through ``ms_efficient.cli.main`` in this
        process (cwd the process's own); None: each in a child process in ``cwd`` (what a
        background computation can do: tests/workers.py)."""
        self.cwd, self.capsys = cwd, capsys
        self.runs = {}
        self.corpus = write_corpus(cwd / "corpus")
        self.outputs = []             # (line, return code, stdout + stderr)

    def write_configs(self, commands):
        """Tiny copies of the configs a train command names, the others as they are."""
        trained = {a for c in commands if c["tool"] == "ms-efficient" and c["argv"][1] == "train"
                   for a in c["argv"] if a.endswith((".yaml", ".yml"))}
        named = {a for c in commands for a in c["argv"] if a.startswith("configs/")}
        for rel in sorted(named):
            dst = self.cwd / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            if rel not in trained:
                shutil.copy(os.path.join(ROOT, rel), dst)
                continue
            with open(os.path.join(ROOT, rel), encoding="utf-8") as fh:
                cfg = yaml.safe_load(fh)
            for section, values in TINY.items():
                cfg.setdefault(section, {}).update(values)
            cfg["data"]["path"] = self.corpus
            dst.write_text(yaml.safe_dump(cfg))

    def readme_steps(self, config):
        with open(os.path.join(ROOT, config), encoding="utf-8") as fh:
            return int(yaml.safe_load(fh)["train"]["steps"])

    def argv_for(self, cmd):
        """The command's ms-efficient arguments with ``--steps`` made small (see above);
        records the run folder's steps."""
        args = list(cmd["argv"][1:])
        if args[0] != "train":
            return args
        steps = _option(args, "--steps")
        resume = _option(args, "--resume")
        if resume is None:
            config = next(a for a in args[1:] if a.endswith((".yaml", ".yml")))
            out = _option(args, "--out") or yaml.safe_load(
                open(self.cwd / config))["train"]["out_dir"]
            readme = int(steps) if steps else self.readme_steps(config)
            if steps:
                args[args.index("--steps") + 1] = str(TINY_STEPS)
            self.runs[out.rstrip("/")] = [readme, TINY_STEPS]
        elif steps:
            readme, test = self.runs[resume.rstrip("/")]
            wanted = int(steps)
            new = test + 1 if wanted > readme else max(1, test - (readme - wanted))
            args[args.index("--steps") + 1] = str(new)
            if wanted > readme:
                self.runs[resume.rstrip("/")] = [wanted, new]
        return args

    def run(self, cmd):
        if cmd["tool"] == "msrun":
            return self.run_msrun(cmd)
        assert cmd["tool"] == "ms-efficient", cmd["line"]
        if "my_net.mindir" in cmd["argv"]:
            self.write_user_graph(self.cwd / "my_net.mindir")
        args = self.argv_for(cmd)
        alternatives = [i for i, a in enumerate(args) if "|" in a]
        assert len(alternatives) <= 1, cmd["line"]
        expanded = ([args[:alternatives[0]] + [kind] + args[alternatives[0] + 1:]
                     for kind in args[alternatives[0]].split("|")] if alternatives else [args])
        for argv in expanded:
            if self.capsys is None:
                done = workers.run_cli(argv, cwd=self.cwd)
                code, out, err = done.returncode, done.stdout, done.stderr
            else:
                self.capsys.readouterr()
                code = main(argv)
                out, err = self.capsys.readouterr()
            text = out + err
            self.outputs.append((" ".join(argv), code, text))
            assert code == 0, f"README command failed: {cmd['line']}\n(ran: {argv})\n{text}"
            assert not re.search(r"\bnan\b", out, re.I), (argv, out)
            assert "nothing to train" not in text, (cmd["line"], text)
            one_process = _option(argv, "--workers") == "1" or (
                "--workers" not in argv and "--resume" not in argv)
            if argv[0] == "train" and one_process:
                assert re.search(r"measured step time \d", out), out

    def run_msrun(self, cmd):
        """The README's msrun line on the repository's example (copied here), 2 steps: each
        rank trains and writes its losses, the ranks' fast-level figures agree."""
        import json

        shutil.copytree(os.path.join(ROOT, "examples"), self.cwd / "examples")
        argv = [workers.MSRUN] + [f"--master_port={workers.free_port()}"
                                  if a.startswith("--master_port=") else a
                                  for a in cmd["argv"][1:]] + ["--steps", "2"]
        env = dict(os.environ)
        for name, value in cmd["env"].items():
            value = value.replace("$PATH", env.get("PATH", ""))
            env[name] = value.replace(".venv/bin", os.path.dirname(sys.executable))
        env["PYTHONPATH"] = os.pathsep.join(p for p in [ROOT, env.get("PYTHONPATH", "")] if p)
        proc = subprocess.run(argv, cwd=self.cwd, env=env, capture_output=True, text=True,
                              timeout=300)
        log_dir = self.cwd / _msrun_option(argv, "--log_dir")
        logs = {n: (log_dir / n).read_text(errors="replace") for n in os.listdir(log_dir)}
        assert proc.returncode == 0, (proc.stdout[-2000:], {n: t[-2000:] for n, t in
                                                            logs.items()})
        assert re.search(r"step 2: loss \d", logs["worker_0.log"]), logs["worker_0.log"][-2000:]
        out = self.cwd / argv[argv.index("--out") + 1]
        ranks = [json.loads((out / f"losses_rank{r}.json").read_text()) for r in range(2)]
        assert [r["world"] for r in ranks] == [2, 2]
        assert [len(r["steps"]) for r in ranks] == [2, 2]
        assert ranks[0]["steps"][1]["rows_per_device"] == ranks[1]["steps"][1]["rows_per_device"]

    @staticmethod
    def write_user_graph(path):
        import mindspore as ms
        from mindspore import nn

        net = nn.SequentialCell(nn.Dense(64, 128), nn.ReLU(), nn.Dense(128, 64))
        ms.export(net, ms.Tensor(np.ones((8, 64), np.float32)),
                  file_name=str(path)[:-len(".mindir")], file_format="MINDIR")
        assert path.is_file()


def _msrun_option(argv, name):
    return next(a.split("=", 1)[1] for a in argv if a.startswith(name + "="))


def _tree(folder):
    """{relative path: (size, mtime_ns)} of every file under ``folder``."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            st = os.stat(path)
            out[os.path.relpath(path, folder)] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture
def quick_start(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    return QuickStart(tmp_path, capsys)


def test_one_process_commands_run_as_written(quick_start):
    """Every quick-start command that needs no msrun, in the README's order; then the
    resumed demo run refuses a --steps it has reached (nothing written) and --help says
    what --steps means."""
    commands = shell_commands()
    skip = _needs_msrun(commands)
    mine = [c for i, c in enumerate(commands) if i not in skip
            and c["argv"][1] != "bench"]
    assert any(c["argv"][1:3] == ["train", "--resume"] for c in mine)
    quick_start.write_configs(commands)
    for cmd in mine:
        quick_start.run(cmd)
    demo = "runs/demo"
    assert demo in quick_start.runs, quick_start.runs
    readme_reached, reached = quick_start.runs[demo]
    assert reached == TINY_STEPS + 1          # the resume trained a step
    _check_refusals(quick_start, demo, reached)
    # train() itself (the API under the command) refuses alike, before writing anything
    from ms_efficient.train.trainer import train

    before = _tree(demo)
    for steps, said in ((reached, f"--steps {reached} is the total step count"),
                        (None, f"its train.steps is {reached}, and")):
        with pytest.raises(ValueError, match="already reached step") as err:
            train(None, resume=demo, steps=steps)
        assert said in str(err.value) and f"N > {reached}" in str(err.value)
    assert _tree(demo) == before


def _check_refusals(quick_start, run, reached, extra=()):
    """``train --resume RUN --steps N`` with N <= the step reached: exit 2, one line naming
    the flag, the value, the step and what to pass; without --steps: nothing to train, exit
    2 too (no silent no-op); neither writes a file."""
    before = _tree(run)
    capsys = quick_start.capsys
    for steps in (reached, 1):
        capsys.readouterr()
        assert main(["train", "--resume", run, "--steps", str(steps), *extra]) == 2
        captured = capsys.readouterr()
        err = captured.err.strip().splitlines()
        assert len(err) == 1, captured.err
        assert (f"--steps {steps} is the total step count the run trains to, not steps to "
                f"add, but '{run}' has already reached step {reached}") in err[0], err[0]
        assert f"Pass --steps N with N > {reached}" in err[0]
        assert f"--steps {reached + steps} trains {steps} more" in err[0]
        assert "step time" not in captured.out
    assert main(["train", "--resume", run, *extra]) == 2
    captured = capsys.readouterr()
    assert f"nothing to train: '{run}' has already reached step {reached}" in captured.err
    assert "step time" not in captured.out and "nan" not in captured.out.lower()
    assert _tree(run) == before


def test_train_help_says_steps_is_the_total(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "the total step count the run trains to" in text and "not steps to add" in text
    assert "--steps 350 trains 50 more" in text and "refused (exit 2)" in text
    assert "The same for --workers runs" in text


def test_no_step_time_is_printed_for_a_run_that_trained_no_step(monkeypatch, capsys):
    """A result with no step trained in this process (step time NaN) prints no step time."""
    from ms_efficient.train import trainer

    result = trainer.TrainResult(out_dir="runs/x", steps=5, first_val_loss=5.5,
                                 final_val_loss=5.0, tokens_per_s=math.nan,
                                 step_time_s=math.nan)
    monkeypatch.setattr(trainer, "train", lambda *a, **k: result)
    assert main(["train", "some.yaml"]) == 0
    out = capsys.readouterr().out
    assert "validation loss: 5.5000 -> 5.0000" in out
    assert "step time" not in out and "nan" not in out.lower()


def test_bench_commands_run_as_written(quick_start):
    """The quick start's ``bench`` line (--quick, as written: under a second; the other
    kinds' benches have tests of their own)."""
    commands = [c for c in shell_commands() if c["tool"] == "ms-efficient"
                and c["argv"][1] == "bench"]
    assert commands
    quick_start.write_configs(shell_commands())     # bench moe reads configs/gpt_moe_tiny.yaml
    for cmd in commands:
        quick_start.run(cmd)
