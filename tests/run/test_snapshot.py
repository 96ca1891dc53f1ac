"""egress.run.snapshot.PolicySnapshot: files the command can write are read once, at the start."""

from __future__ import annotations

import os

import pytest

from egress.policy.loader import PolicyError, load_policy, policy_from_mapping
from egress.run.snapshot import PolicySnapshot
from sandbox.paths import command_writable


@pytest.fixture
def dirs(tmp_path):
    tmp_path = tmp_path.resolve()
    project, outside = tmp_path / "project", tmp_path / "outside"
    project.mkdir()
    outside.mkdir()
    return project, outside


def sealed(reader: PolicySnapshot, project) -> PolicySnapshot:
    reader.seal(lambda path: command_writable(path, [project]))
    return reader


def test_a_file_the_command_can_write_keeps_its_text_and_lines_from_the_start(dirs):
    project, _ = dirs
    policy = project / "egress.toml"
    policy.write_text('# mine\nallow = ["mine.example.com"]\n')
    reader = PolicySnapshot()
    load_policy([str(policy)], read=reader)
    sealed(reader, project)
    policy.write_text('\n\n\nallow = ["mine.example.com", "evil.example.com"]\n')  # the command's edit
    later = load_policy([str(policy)], read=reader)
    assert not later.decide("evil.example.com", 443).allowed
    rule = later.decide("mine.example.com", 443).rule
    assert rule.location() == f"{policy}:2"  # the line in the text in force, not in the edit
    assert reader.frozen_files == {str(policy)}


def test_a_file_outside_stays_live(dirs):
    project, outside = dirs
    policy = outside / "policy.toml"
    policy.write_text('allow = ["one.example.com"]\n')
    reader = PolicySnapshot()
    load_policy([str(policy)], read=reader)
    sealed(reader, project)
    policy.write_text('allow = ["two.example.com"]\n')
    assert load_policy([str(policy)], read=reader).decide("two.example.com", 443).allowed
    assert reader.frozen_files == frozenset()


def test_a_new_include_into_the_project_is_refused_unread(dirs):
    project, outside = dirs
    policy = outside / "policy.toml"
    policy.write_text('allow = ["one.example.com"]\n')
    (project / "evil.toml").write_text('allow = ["evil.example.com"]\n')
    reader = PolicySnapshot()
    policy_from_mapping({"include": [str(policy)]}, read=reader)
    sealed(reader, project)
    policy.write_text(f'include = ["{project}/evil.toml"]\n')  # a live edit of the outside file
    with pytest.raises(PolicyError) as info:
        policy_from_mapping({"include": [str(policy)]}, read=reader)
    assert [str(p) for p in info.value.problems] == [
        f"{project}/evil.toml: inside a folder the command can write; "
        f"only files read when the run started are used"]


def test_a_deleted_or_repointed_file_still_gives_its_start_text(dirs):
    project, outside = dirs
    (outside / "team.toml").write_text('allow = ["team.example.com"]\n')
    (project / "evil.toml").write_text('allow = ["evil.example.com"]\n')
    os.symlink(outside / "team.toml", project / "team.toml")  # a link the command can repoint
    (project / "egress.toml").write_text('include = ["team.toml"]\n')
    reader = PolicySnapshot()
    load_policy([str(project / "egress.toml")], read=reader)
    sealed(reader, project)
    (project / "egress.toml").unlink()
    (project / "team.toml").unlink()
    os.symlink(project / "evil.toml", project / "team.toml")
    later = load_policy([str(project / "egress.toml")], read=reader)
    assert later.decide("team.example.com", 443).allowed
    assert not later.decide("evil.example.com", 443).allowed
    assert later.files == [str(project / "egress.toml"), str(outside / "team.toml")]  # as resolved at start


def test_files_read_at_start_that_the_command_cannot_write_are_not_kept(dirs):
    project, outside = dirs
    policy = outside / "policy.toml"
    policy.write_text('allow = ["one.example.com"]\n')
    reader = PolicySnapshot()
    load_policy([str(policy)], read=reader)
    policy.write_text('allow = ["two.example.com"]\n')  # edited before the seal: the run starts with it
    sealed(reader, project)
    assert load_policy([str(policy)], read=reader).decide("two.example.com", 443).allowed


def test_a_predicate_that_cannot_answer_freezes(dirs):
    _, outside = dirs
    policy = outside / "policy.toml"
    policy.write_text('allow = ["one.example.com"]\n')
    reader = PolicySnapshot()

    def broken(path: str) -> bool:
        raise OSError("cannot tell")

    reader.seal(broken)
    with pytest.raises(PolicyError, match="inside a folder the command can write"):
        load_policy([str(policy)], read=reader)


def test_a_snapshot_rebuilt_elsewhere_serves_the_same_texts_and_refuses_the_same_files(dirs):
    # The warm proxy's child rebuilds the launcher's sealed snapshot from what it recorded.
    project, outside = dirs
    frozen, live = project / "egress.toml", outside / "policy.toml"
    frozen.write_text('allow = ["mine.example.com"]\n')
    live.write_text('allow = ["one.example.com"]\n')
    reader = PolicySnapshot()
    load_policy([str(frozen), str(live)], read=reader)
    sealed(reader, project)
    frozen.write_text('allow = ["evil.example.com"]\n')
    live.write_text('allow = ["two.example.com"]\n')
    (project / "new.toml").write_text('allow = ["new.example.com"]\n')
    copy = PolicySnapshot.sealed(reader.recorded(), lambda path: command_writable(path, [project]))
    assert copy.frozen_files == reader.frozen_files
    later = load_policy([str(frozen), str(live)], read=copy)
    assert [later.decide(h, 443).allowed for h in ("mine.example.com", "evil.example.com", "two.example.com")] == \
        [True, False, True]
    with pytest.raises(PolicyError):
        load_policy([str(project / "new.toml")], read=copy)
