"""A scope written with a `${name}` inside it (`{"tag": "${tag}"}`, as every catalog experiment
writes it) is checked by `chaosgpu validate` and by the pre-run check of `chaos run`, as the run
will pass it.

Before, validation skipped any argument holding a `${...}` anywhere below it: a typo'd scope
key beside `"tag": "${tag}"`, or a tag "x y" from the configuration or a `--var`, validated,
and `chaos run` started the method (its first step ran) before the activity refused the
scope. Now each `${name}` is substituted as Chaos Toolkit substitutes it (a whole `${name}` takes
the value with its type, one inside a longer text is formatted into it) from what is known
before the run (the configuration's literal values, the `--var`s); a part only the run can
tell (a secret, an environment variable) is left unknown, and what does not depend on it (the
scope's keys, its other values) is still checked: never is a scope refused only because a part
of it is unknown.

The real CLIs run on experiments written here; the method's first step writes a marker file,
so a run refused before anything is touched leaves no marker.
"""

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from experiment_helpers import CHAOS, activity, experiment
from experiment_helpers import chaos_run as _chaos_run
from experiment_helpers import validate as _validate

REFUSED = "bad argument values, refused before anything runs"
UNKNOWN_KEY = "unknown scope key(s) ['incude_other_users']"
#: a tag no process on this machine carries: a run that gets to the freeze touches nothing
NO_SUCH_TAG = "validate-templated-scope-nothing"


def _marker_step() -> dict[str, Any]:
    """The method's first step: writes `marker` in the run's directory."""
    return {"type": "action", "name": "marker", "provider": {
        "type": "process", "path": shutil.which("touch") or "touch", "arguments": "marker"}}


def _experiment(scope: Any, configuration: dict[str, Any] | None = None,
                timeline: bool = False, **extra: Any) -> dict[str, Any]:
    """Write a marker, then freeze the processes of `scope`; the pre-run check is the
    chaosgpu.validation control, or the timeline control's first step (`timeline`)."""
    if timeline:
        control = {"name": "chaosgpu-timeline", "provider": {
            "type": "python", "module": "chaosgpu.timeline.control",
            "arguments": {"rate_hz": 20, "source": "host-rss", "scope": {"tag": "${tag}"}}}}
    else:
        control = {"name": "chaosgpu-validation",
                   "provider": {"type": "python", "module": "chaosgpu.validation"}}
    return experiment(_marker_step(), activity("chaosgpu.process.actions", "freeze_processes",
                                               {"scope": scope}, name="freeze"),
                      configuration=configuration or {"tag": NO_SUCH_TAG},
                      controls=[control], **extra)


def _refused(done: subprocess.CompletedProcess[str], *said: str) -> None:
    assert done.returncode == 1, done.stdout + done.stderr
    for text in (REFUSED, "method['freeze']: freeze_processes: scope must be a valid scope",
                 *said):
        assert text in done.stderr, (text, done.stderr)


def _valid(done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 0, done.stdout + done.stderr
    assert '"valid": true' in done.stdout, done.stdout


def _run_refused(tmp_path: Path, document: dict[str, Any], *said: str,
                 options: tuple[str, ...] = ()) -> None:
    """`chaos run [options]` stops before the method: interrupted, nothing in its journal's
    run, the reason in its log, and no marker."""
    (tmp_path / "marker").unlink(missing_ok=True)  # an earlier run's, in the same tmp_path
    if options:  # experiment_helpers.chaos_run passes no options
        run, journal, log = _chaos_run_with(tmp_path, document, *options)
    else:
        run, journal, log = _chaos_run(tmp_path, document)
    assert run.returncode != 0, run.stdout + run.stderr
    assert journal["status"] == "interrupted" and journal["run"] == [], journal["run"]
    for text in said:
        assert text in log, (text, log[-3000:])
    assert not (tmp_path / "marker").exists()  # the method's first step never ran


def _chaos_run_with(tmp_path: Path, document: dict[str, Any], *options: str
                    ) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], str]:
    """`chaos run OPTIONS` of `document` in tmp_path: the process, its journal and its log."""
    path = tmp_path / "experiment.json"
    path.write_text(json.dumps(document))
    journal = tmp_path / "journal.json"
    run = subprocess.run([CHAOS, "--no-version-check", "--log-file", str(tmp_path / "log"),
                          "run", *options, "--journal-path", str(journal), str(path)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         stdin=subprocess.DEVNULL, env=dict(os.environ))
    return run, json.loads(journal.read_text()), (tmp_path / "log").read_text()


def test_a_typo_d_key_beside_a_templated_tag_is_refused_before_anything_runs(
        tmp_path: Path) -> None:
    """The outside tester's case: `{"tag": "${tag}", "incude_other_users": true}` validated,
    and with the timeline control the run wrote the marker before freeze_processes failed."""
    scope = {"tag": "${tag}", "incude_other_users": True}
    for timeline in (False, True):
        document = _experiment(scope, timeline=timeline)
        _refused(_validate(tmp_path, document), UNKNOWN_KEY,
                 f"got {{'tag': '{NO_SUCH_TAG}', 'incude_other_users': True}}")
        _run_refused(tmp_path, document, REFUSED, UNKNOWN_KEY)
    # the literal scope was refused before too: the same words
    _refused(_validate(tmp_path, _experiment({"tag": "x", "incude_other_users": True})),
             UNKNOWN_KEY)


def test_a_bad_tag_from_the_configuration_or_a_var_is_refused_naming_it(
        tmp_path: Path) -> None:
    """`${tag}` takes the configuration's value, or a `--var`'s with its type: a tag with a
    space, or a number, is one no scope takes (the activity itself refuses it)."""
    bad_tag = "scope 'tag' must be a tag: a non-empty string without whitespace"
    document = _experiment({"tag": "${tag}"}, configuration={"tag": "x y"})
    _refused(_validate(tmp_path, document), bad_tag, "got {'tag': 'x y'}")
    _run_refused(tmp_path, document, REFUSED, bad_tag, "got {'tag': 'x y'}")
    # inside a longer text the value is formatted into it, as Chaos Toolkit does
    _refused(_validate(tmp_path, _experiment({"tag": "ring-${tag}"},
                                             configuration={"tag": "x y"})),
             bad_tag, "got {'tag': 'ring-x y'}")

    document = _experiment({"tag": "${tag}"})
    _valid(_validate(tmp_path, document))
    _refused(_validate(tmp_path, document, "--var", "tag=x y"), bad_tag,
             "got {'tag': 'x y'}")
    _refused(_validate(tmp_path, document, "--var", "tag:float=1"), bad_tag,
             "got {'tag': 1.0}")
    _run_refused(tmp_path, document, REFUSED, bad_tag, "got {'tag': 1.0}",
                 options=("--var", "tag:float=1"))
    _run_refused(tmp_path, _experiment({"tag": "${tag}"}, timeline=True), REFUSED,
                 bad_tag, "got {'tag': 'x y'}", options=("--var", "tag=x y"))


def test_a_part_only_the_run_can_tell_is_left_to_it_and_the_keys_are_still_checked(
        tmp_path: Path) -> None:
    """A tag from a secret or an environment variable is unknown to validate: the scope passes
    (and the run goes on to the method), but a typo'd key or a bad literal option beside it is
    refused whatever the tag turns out to be."""
    env = {"TEMPLATED_SCOPE_TOKEN": NO_SUCH_TAG, "TEMPLATED_SCOPE_TAG": NO_SUCH_TAG}
    secret = {"secrets": {"s": {"token": {"type": "env", "key": "TEMPLATED_SCOPE_TOKEN"}}}}
    from_env = {"tag": NO_SUCH_TAG,
                "env_tag": {"type": "env", "key": "TEMPLATED_SCOPE_TAG"}}
    for name, configuration, extra in (("token", None, secret),
                                       ("env_tag", from_env, {})):
        placeholder = f"${{{name}}}"
        good = _experiment({"tag": placeholder, "include_other_users": False},
                           configuration, **extra)
        _valid(_validate(tmp_path, good, env=env))
        _valid(_validate(tmp_path, _experiment({"tag": f"ring-{placeholder}"}, configuration,
                                               **extra), env=env))
        _refused(_validate(tmp_path, _experiment({"tag": placeholder,
                                                  "incude_other_users": True},
                                                 configuration, **extra), env=env),
                 UNKNOWN_KEY, f"got {{'tag': '{placeholder}', 'incude_other_users': True}}")
        _refused(_validate(tmp_path, _experiment({"tag": placeholder,
                                                  "include_other_users": "yes"},
                                                 configuration, **extra), env=env),
                 "scope option 'include_other_users' must be true or false, got 'yes'")
        _refused(_validate(tmp_path, _experiment({"tag": placeholder, "job": "j"},
                                                 configuration, **extra), env=env),
                 "a scope names exactly one kind of target")

    # the pre-run check does not stop it: the marker is written, the freeze finds no process
    run, journal, log = _chaos_run(tmp_path, _experiment({"tag": "${token}"}, **secret),
                                   env=env)
    assert REFUSED not in log, log[-3000:]
    assert (tmp_path / "marker").exists(), run.stdout + run.stderr
    assert [step["activity"]["name"] for step in journal["run"]] == ["marker", "freeze"]


def test_the_timeline_control_s_templated_scope_is_checked_too(tmp_path: Path) -> None:
    """The control's own scope: `{"tag": "${token}", "incude_other_users": true}` (a secret)
    cannot start the control whatever the token is."""
    env = {"TEMPLATED_SCOPE_TOKEN": NO_SUCH_TAG}
    document = _experiment({"tag": "${tag}"}, timeline=True, secrets={
        "s": {"token": {"type": "env", "key": "TEMPLATED_SCOPE_TOKEN"}}})
    _valid(_validate(tmp_path, document, env=env))
    document["controls"][0]["provider"]["arguments"]["scope"] = {
        "tag": "${token}", "incude_other_users": True}
    done = _validate(tmp_path, document, env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "controls['chaosgpu-timeline']: the timeline control cannot start (" in done.stderr
    assert "incude_other_users" in done.stderr, done.stderr


BOGUS_KEY = "unknown scope key(s) ['bogus']"
BAD_TAG = "scope 'tag' must be a tag: a non-empty string without whitespace"


def _ran_on(tmp_path: Path, document: dict[str, Any], *said: str) -> None:
    """`chaos run` was not stopped before the method: the marker is written, the freeze ran,
    and its log says each of `said` (what the freeze itself said)."""
    for stale in ("marker", "journal.json", "log"):
        (tmp_path / stale).unlink(missing_ok=True)
    run, journal, log = _chaos_run(tmp_path, document)
    assert REFUSED not in log, log[-3000:]
    assert (tmp_path / "marker").exists(), run.stdout + run.stderr
    assert [step["activity"]["name"] for step in journal["run"]] == ["marker", "freeze"]
    for text in said:
        assert text in log, (text, log[-3000:])


def _unchecked(document: dict[str, Any]) -> dict[str, Any]:
    """`document` without its pre-run check: the activity alone judges its arguments."""
    return {key: value for key, value in document.items() if key != "controls"}


def test_a_literal_dict_from_the_configuration_is_the_scope_and_is_checked(
        tmp_path: Path) -> None:
    """The outside tester's case: `"scope": "${scope}"` with a configuration scope holding a
    typo'd key was taken for a value only the run knows (a mapping, like an env-typed one):
    validate said valid, and `chaos run` ran the method's first step before the freeze refused
    the scope. A literal dict is a value: the run passes it whole, keys and all."""
    bad = {"tag": NO_SUCH_TAG, "bogus": 1}
    for timeline in (False, True):
        document = _experiment("${scope}", {"scope": bad, "tag": NO_SUCH_TAG},
                               timeline=timeline)
        _refused(_validate(tmp_path, document), BOGUS_KEY, f"got {bad!r}")
        _run_refused(tmp_path, document, REFUSED, BOGUS_KEY)
    # what the activity itself says of it, when nothing checks before the run
    _ran_on(tmp_path, _unchecked(document), BOGUS_KEY)
    # the same dict from a `--var NAME:json=...`
    good_document = _experiment("${scope}", {"scope": {"tag": NO_SUCH_TAG}})
    _refused(_validate(tmp_path, good_document, "--var", f"scope:json={json.dumps(bad)}"),
             BOGUS_KEY)
    _run_refused(tmp_path, good_document, REFUSED, BOGUS_KEY,
                 options=("--var", f"scope:json={json.dumps(bad)}"))
    # a good scope passes both: the run goes on to the method (the freeze finds nothing)
    _valid(_validate(tmp_path, good_document))
    _ran_on(tmp_path, good_document, f"scope tag={NO_SUCH_TAG} matched no process")
    # an env-typed configuration value is still the run's to tell
    from_env = _experiment("${scope}", {"scope": {"type": "env", "key": "TEMPLATED_SCOPE_S"}})
    _valid(_validate(tmp_path, from_env, env={"TEMPLATED_SCOPE_S": "anything"}))


def test_a_dict_formatted_into_a_text_is_checked_as_the_activity_gets_it(
        tmp_path: Path) -> None:
    """`"trialC-${suffix}"` with a dict `suffix`: Chaos Toolkit formats str(dict) into the text,
    "trialC-{'a': 1}" (a space: no tag), "trialC-{}" (a tag). Refused or accepted exactly as
    the freeze refuses or accepts it when nothing checks before the run."""
    refused_tag = "\"trialC-{'a': 1}\""
    document = _experiment({"tag": "trialC-${suffix}"}, {"suffix": {"a": 1}})
    _refused(_validate(tmp_path, document), BAD_TAG, f"got {refused_tag}")
    _run_refused(tmp_path, document, REFUSED, BAD_TAG, f"got {refused_tag}")
    _ran_on(tmp_path, _unchecked(document), BAD_TAG, f"got {refused_tag}")

    document = _experiment({"tag": "trialC-${suffix}"}, {"suffix": {}})
    _valid(_validate(tmp_path, document))
    _ran_on(tmp_path, document, "scope tag=trialC-{} matched no process")
    # a list is formatted the same way, and `$name` (no braces) is substituted too
    _refused(_validate(tmp_path, _experiment({"tag": "trialC-$suffix"},
                                             {"suffix": {"a": 1}})),
             BAD_TAG, f"got {refused_tag}")
    _refused(_validate(tmp_path, _experiment({"tag": "${suffix}-x"}, {"suffix": [1, 2]})),
             BAD_TAG, "got '[1, 2]-x'")


def test_an_unbraced_name_is_substituted_as_chaoslib_substitutes_it(tmp_path: Path) -> None:
    """chaoslib substitutes `$name` from the configuration, secrets and `--var`s, always as text
    (its typed substitution matches only `${name}`), and leaves a `$name` that none defines
    as written: a `$tagg` typo reaches the freeze as the tag "$tagg", which it takes (a tag
    nothing carries), so validate takes it too. A `$name` that a secret defines is the run's
    to tell, not the text "$name": `"rank": "$r"` passes when the secret is "any"."""
    document = _experiment({"tag": "$tagg"})
    _valid(_validate(tmp_path, document))
    _ran_on(tmp_path, document, "scope tag=$tagg matched no process")

    secret = {"s": {"r": {"type": "env", "key": "TEMPLATED_SCOPE_RANK"}}}
    kill = experiment(activity("chaosgpu.job.actions", "kill_rank",
                               {"rank": "$r", "tag": NO_SUCH_TAG}, name="kill"),
                      secrets=secret)
    _valid(_validate(tmp_path, kill, env={"TEMPLATED_SCOPE_RANK": "any"}))
    # from the configuration it is known now: text, which no rank number is
    kill = experiment(activity("chaosgpu.job.actions", "kill_rank",
                               {"rank": "$r", "tag": NO_SUCH_TAG}, name="kill"),
                      configuration={"r": 1})
    done = _validate(tmp_path, kill)
    assert done.returncode == 1 and "rank must be" in done.stderr, done.stdout + done.stderr
    assert "got '1'" in done.stderr, done.stderr
