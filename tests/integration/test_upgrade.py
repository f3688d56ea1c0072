"""Upgrades and rollbacks inside the schema window (issue 26, "Done when"): the previous release,
built from its commit, runs on the new schema, and the new release runs on the previous
schema; a rollback inside the window starts cleanly; outside it, the refusal names the release
to run. docs/operations.md, "Upgrading and rolling back"."""

import os
import re
import shutil
import subprocess

from dispatchcase import SECRET, DispatchCase, main, run_id
from tallytest import BUILD_DIR, PROGRAM_ROLES, SOURCE_DIR, Proc, free_port, wait_for

# The previous release: its name, the commit tagged v<name>, and its newest schema (a clone
# without tags still has the commit: it is an ancestor of main).
PREVIOUS = ("0.1.0", "c86a30d8412233478c48290abe3a94056a027194", 15)
PROGRAMS = ("tally", "tally-dispatcher", "tally-reconciler", "tally-compensator")


def this_release():
    """This tree's release (CMakeLists.txt's project version) and newest schema."""
    with open(os.path.join(SOURCE_DIR, "CMakeLists.txt")) as f:
        version = re.search(r"project\(tally VERSION (\d+\.\d+\.\d+)", f.read()).group(1)
    newest = max(int(n[:3]) for n in os.listdir(os.path.join(SOURCE_DIR, "schemas", "sql"))
                 if re.match(r"\d{3}_.*\.sql$", n))
    return version, newest


RELEASE, NEWEST = this_release()


def previous_release():
    """The previous release's binaries, built once from its commit into the build tree (kept
    between runs while the commit is the same); returns the directory that holds them."""
    name, commit, _ = PREVIOUS
    out = os.path.join(BUILD_DIR, f"release-{name}")
    stamp = os.path.join(out, "commit")
    if os.path.exists(stamp) and open(stamp).read().strip() == commit and all(
            os.path.exists(os.path.join(out, "build", p)) for p in PROGRAMS):
        return os.path.join(out, "build")
    # The tag, where the clone has it, must name the same commit as this file.
    tag = subprocess.run(["git", "-C", SOURCE_DIR, "rev-parse", "--verify", "-q",
                          f"v{name}^{{commit}}"], capture_output=True, text=True)
    if tag.returncode == 0:
        assert tag.stdout.strip() == commit, f"tag v{name} is {tag.stdout.strip()}, not {commit}"
    shutil.rmtree(out, ignore_errors=True)
    src = os.path.join(out, "src")
    os.makedirs(src)
    archive = subprocess.run(["git", "-C", SOURCE_DIR, "archive", "--format=tar", commit],
                             capture_output=True)
    assert archive.returncode == 0, (
        f"the previous release's commit {commit} is not in this clone: "
        f"{archive.stderr.decode(errors='replace')}")
    subprocess.run(["tar", "-x", "-C", src], input=archive.stdout, check=True)
    build = os.path.join(out, "build")
    cfg = subprocess.run(
        ["cmake", "-S", src, "-B", build, "-DCMAKE_BUILD_TYPE=RelWithDebInfo",
         "-DTALLY_SANITIZE=OFF", "-DTALLY_BUILD_TESTS=OFF", "-DTALLY_BUILD_BENCH=OFF"],
        capture_output=True, text=True)
    assert cfg.returncode == 0, cfg.stdout + cfg.stderr
    jobs = str(os.cpu_count() or 2)
    made = subprocess.run(["cmake", "--build", build, "-j", jobs, "--target", *PROGRAMS],
                          capture_output=True, text=True)
    assert made.returncode == 0, made.stdout[-4000:] + made.stderr[-4000:]
    with open(stamp, "w") as f:
        f.write(commit + "\n")
    return build


class UpgradeTest(DispatchCase):

    migrate = False  # each test chooses which release migrates

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.old_dir = previous_release()

    # --- the two releases --------------------------------------------------------------

    def migrate_with(self, directory):
        env = self._as_role(self.env(), "owner")
        return subprocess.run([os.path.join(directory, "tally"), "migrate"], capture_output=True,
                              text=True, env=env, timeout=120)

    def start_old(self, name, wait_ready=True, **extra):
        """A worker of the previous release, as start() starts this one's."""
        port = free_port()
        env = self.env(TALLY_METRICS_ADDR=f"127.0.0.1:{port}", **extra)
        env = self._as_role(env, PROGRAM_ROLES[name])
        p = Proc(f"old-{name}", [os.path.join(self.old_dir, name)], env, self.tmp)
        p.metrics_port = port
        self.procs.append(p)
        if wait_ready:
            wait_for(lambda: not p.alive() or self._healthy(p), timeout=60,
                     what=f"0.1.0's {name} /healthz")
            self.assertTrue(p.alive(), f"0.1.0's {name} exited early:\n{p.log()}")
        return p

    def old_dispatcher(self):
        return self.start_old("tally-dispatcher", TALLY_FAKE_TOOL_URL=self.fake_url,
                              BILLING_HMAC_SECRET=SECRET, TALLY_POLL_MS=200,
                              TALLY_SHUTDOWN_GRACE_MS=5000)

    def version(self):
        return self.scalar("SELECT max(version) FROM tally_migrations")

    def confirm_one(self):
        """An intent through whichever dispatcher runs: it reaches CONFIRMED, and its outcome
        reaches the outcomes topic whole, whichever relays run (a 0.1.0 relay never sees an
        outcome written by reference, message_refs: it would publish garbage and delete it)."""
        run = run_id()
        self.publish(self.intent(run, 1, "send_email", {"message_id": f"{run}-m",
                                                        "to": "a@example.com", "subject": "hi"}))
        self.wait_count("SELECT count(*) FROM effects WHERE run_id = %s AND status = 'CONFIRMED'",
                        1, (run,))
        effect_id, receipt = self.query("SELECT effect_id::text, receipt FROM effects"
                                        " WHERE run_id = %s", (run,))[0]
        got = self.read_until("outcomes", lambda ms: any(
            m.get("data", {}).get("run_id") == run for m in ms), timeout=30)
        [m] = [m for m in got if m.get("data", {}).get("run_id") == run]
        self.assertEqual((m["type"], m["data"]["effect_id"], m["data"]["receipt"]),
                         ("tally.effect.confirmed.v1", effect_id, receipt))
        return run

    def warnings(self, proc):
        return [line["msg"] for line in proc.log_lines() if line.get("level") == "warn"]

    # --- inside the window -------------------------------------------------------------

    def test_the_new_release_runs_on_the_previous_schema_then_migrates_under_it(self):
        out = self.migrate_with(self.old_dir)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertEqual(self.version(), PREVIOUS[2])

        # the new workers start before the migration has run
        d = self.dispatcher()
        workers = (d, self.start("tally-reconciler"), self.start("tally-compensator"))
        self.assertTrue(any("older than tally" in m and "inside the schemas it runs on" in m
                            for m in self.warnings(d)), d.log())
        self.confirm_one()

        # the plan sees them, all served after the expand step
        plan = self.cli("migrate", "--plan", env=self._as_role(self.env(), "owner"))
        self.assertEqual(plan.returncode, 0, plan.stdout + plan.stderr)
        self.assertRegex(plan.stdout, r"016_\w+\s+expand")
        self.assertRegex(plan.stdout, rf"tally-dispatcher/{re.escape(RELEASE)} "
                         rf"\(schema {PREVIOUS[2]}-{NEWEST}\)\s+served after")
        self.assertNotIn("NOT SERVED", plan.stdout)

        # migrating under running workers: they carry on
        out = self.cli("migrate")
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertIn("(was 15)", out.stdout)
        self.assertGreater(self.version(), PREVIOUS[2])
        self.assertEqual(self.query("SELECT from_version, to_version, release, serves_from"
                                    " FROM tally_schema_history"),
                         [(15, self.version(), RELEASE, 15)])
        run = self.confirm_one()
        self.assertTrue(d.alive(), d.log())

        # Their relays, started on schema 15, find message_refs (migration 17) within a second
        # and drain it: a reference to the transition that confirmed the last effect goes out,
        # built from the ledger.
        for p in workers:
            wait_for(lambda p=p: "draining it too" in p.log(), timeout=15,
                     what=f"{p.name}'s relay to take message_refs")
        effect_id, transition, receipt = self.query(
            "SELECT e.effect_id::text, ev.event_id::text, e.receipt FROM effects e"
            " JOIN events ev ON ev.run_id = e.run_id AND ev.effect_id = e.effect_id"
            " WHERE e.run_id = %s AND ev.kind = 'transition' AND ev.to_status = 'CONFIRMED'",
            (run,))[0]
        self.query("INSERT INTO message_refs (event_id, msg_key) VALUES (%s, %s)",
                   (transition, run))
        # the dispatcher started on schema 15 wrote that outcome as a copy, under the same id
        # (the transition's): the copy, then the reference, built from the ledger
        got = self.read_until("outcomes", lambda ms: sum(
            m.get("id") == transition for m in ms) == 2, timeout=30)
        for m in [m for m in got if m.get("id") == transition]:
            self.assertEqual((m["type"], m["subject"], m["data"]["effect_id"],
                              m["data"]["run_id"], m["data"]["receipt"]),
                             ("tally.effect.confirmed.v1", effect_id, effect_id, run, receipt))
        self.wait_count("SELECT count(*) FROM message_refs", 0)

    def test_the_previous_release_runs_on_the_new_schema_and_a_rollback_starts_cleanly(self):
        out = self.cli("migrate")
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        new_version = self.version()
        self.assertGreater(new_version, PREVIOUS[2])

        # a rollout in progress: a new dispatcher and an old one side by side
        new = self.dispatcher()
        old = self.old_dispatcher()
        self.assertTrue(any("a later release migrated it and still serves this one" in m
                            for m in self.warnings(old)), old.log())
        plan = self.cli("migrate", "--plan", env=self._as_role(self.env(), "owner"))
        self.assertEqual(plan.returncode, 0, plan.stdout + plan.stderr)
        self.assertRegex(plan.stdout, r"tally-dispatcher/0\.1\.0 \(schema 15-15\)\s+served after")
        # side by side, with the old dispatcher's relay taking rows too: every outcome whole
        for _ in range(3):
            self.confirm_one()

        # the rollback: every new worker stops, the previous release's take over
        def assignments():
            return sum("consumer group rebalance" in str(ln.get("msg", "")) and
                       " assigned " in ln["msg"] for ln in old.log_lines())
        before = assignments()
        self.assertEqual(new.terminate(), 0)
        # the old dispatcher takes the partitions over (its group settles before it is stopped)
        wait_for(lambda: assignments() > before, timeout=60,
                 what="0.1.0's dispatcher assigned the partitions the new one left")
        self.start_old("tally-reconciler")
        self.start_old("tally-compensator")
        self.confirm_one()
        # the previous release's migrate Job finds nothing to do, and changes nothing
        again = self.migrate_with(self.old_dir)
        self.assertEqual(again.returncode, 0, again.stdout + again.stderr)
        self.assertIn(f"database at version {new_version}, nothing to do", again.stdout)
        self.assertEqual(self.version(), new_version)
        self.assertTrue(old.alive(), old.log())
        self.assertEqual(old.terminate(), 0)

    # --- outside it ----------------------------------------------------------------------

    def test_outside_the_window_the_refusal_names_the_release_to_run(self):
        out = self.cli("migrate")
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        # what a later release's contract step leaves: it no longer serves schema 15
        self.query("UPDATE tally_schema_window SET serves_from = 16,"
                   " serves_from_release = '0.2.0'")
        old = self.start_old("tally-dispatcher", wait_ready=False)
        self.assertEqual(old.popen.wait(60), 1, old.log())
        [refusal] = [line["msg"] for line in old.log_lines() if line.get("level") == "error"]
        self.assertIn("serves binaries from schema 16 (tally 0.2.0) on", refusal)
        self.assertIn("this is tally 0.1.0 (schema 15): deploy tally 0.2.0 or newer", refusal)
        # the previous release's migrate refuses too, naming the same release
        again = self.migrate_with(self.old_dir)
        self.assertEqual(again.returncode, 1, again.stdout + again.stderr)
        self.assertIn("deploy tally 0.2.0 or newer", again.stderr)

    def test_a_schema_older_than_the_window_asks_for_the_migration(self):
        # a ledger at 14, before the window existed
        self.query("CREATE TABLE tally_migrations (version int PRIMARY KEY, name text NOT NULL,"
                   " applied_at timestamptz NOT NULL DEFAULT now())")
        self.query("INSERT INTO tally_migrations (version, name)"
                   " SELECT v, 'before' FROM generate_series(1, 14) v")
        self.query("GRANT SELECT ON tally_migrations TO PUBLIC")
        for start in (self.start_old, self.start):
            p = start("tally-dispatcher", wait_ready=False)
            self.assertEqual(p.popen.wait(60), 1, p.log())
            [refusal] = [line["msg"] for line in p.log_lines() if line.get("level") == "error"]
            self.assertIn("database schema is at version 14", refusal)
            self.assertRegex(refusal, rf"run `tally migrate` of tally "
                                      rf"({re.escape(PREVIOUS[0])}|{re.escape(RELEASE)}) first")
        # what the refusal asks for (here, on an empty ledger): then the workers start
        self.query("DROP TABLE tally_migrations")
        out = self.cli("migrate")
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.dispatcher()


if __name__ == "__main__":
    main()
