"""The workers and `tally migrate` against a PostgreSQL that takes TLS connections only,
verified with sslmode=verify-full against a CA this test makes (issue 23): a connection
without TLS is refused by the server, one that trusts another CA is refused by libpq, and
the dispatcher records and delivers over the verified connection."""

import os
import shutil
import subprocess
import tempfile

import psycopg2

import tallytest
from dispatchcase import DispatchCase, main, run_id
from tallytest import free_port, wait_for


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(d, name):
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            "-keyout", f"{name}.key", "-out", f"{name}.crt", "-subj", f"/CN=tally test {name}",
            cwd=d)


def as_postgres():
    """PostgreSQL refuses to run as root: as root, its programs run as the postgres user (as
    `tally dev` does)."""
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


def pg_bindir():
    for major in sorted(os.listdir("/usr/lib/postgresql"), key=lambda m: int(m), reverse=True):
        d = f"/usr/lib/postgresql/{major}/bin"
        if os.path.exists(os.path.join(d, "initdb")):
            return d
    raise RuntimeError("no PostgreSQL server binaries under /usr/lib/postgresql")


class PostgresTLSTest(DispatchCase):

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="tally-pg-tls-")
        d = cls.dir
        make_ca(d, "ca")
        make_ca(d, "other-ca")
        with open(os.path.join(d, "san.cnf"), "w") as f:
            f.write("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out",
                "server.csr", "-subj", "/CN=localhost", cwd=d)
        openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", "-days", "2", "-out", "server.crt", "-extfile", "san.cnf",
                cwd=d)
        os.chmod(os.path.join(d, "server.key"), 0o600)
        if os.geteuid() == 0:
            shutil.chown(d, "postgres")
            os.chmod(d, 0o755)
            for f in ("server.key", "server.crt"):
                shutil.chown(os.path.join(d, f), "postgres")
        bindir = pg_bindir()
        cls.data = os.path.join(d, "data")
        subprocess.run([*as_postgres(), f"{bindir}/initdb", "-D", cls.data, "-U", "tally", "-A",
                        "trust", "--no-sync"], check=True, capture_output=True)
        cls.port = free_port()
        with open(os.path.join(cls.data, "postgresql.conf"), "a") as f:
            f.write(f"listen_addresses = '127.0.0.1'\nport = {cls.port}\n"
                    f"unix_socket_directories = '{d}'\nssl = on\n"
                    f"ssl_cert_file = '{d}/server.crt'\nssl_key_file = '{d}/server.key'\n"
                    "fsync = off\n")
        # TCP only over TLS; the local socket is the test's own back door for nothing
        with open(os.path.join(cls.data, "pg_hba.conf"), "w") as f:
            f.write("hostssl all all 127.0.0.1/32 trust\n"
                    "hostnossl all all 0.0.0.0/0 reject\n")
        subprocess.run([*as_postgres(), f"{bindir}/pg_ctl", "start", "-D", cls.data, "-w", "-l",
                        os.path.join(d, "pg.log")], check=True, capture_output=True)
        cls.bindir = bindir
        super().setUpClass()

    @classmethod
    def tearDownClass(cls):
        subprocess.run([*as_postgres(), f"{cls.bindir}/pg_ctl", "stop", "-D", cls.data, "-m",
                        "fast", "-w"], capture_output=True)
        shutil.rmtree(cls.dir, ignore_errors=True)
        super().tearDownClass()

    def dsn(self, dbname="postgres", ca="ca.crt", mode="verify-full"):
        return (f"host=localhost port={self.port} user=tally dbname={dbname} sslmode={mode}"
                f" sslrootcert={os.path.join(self.dir, ca)}")

    def tls_database(self):
        name = "t_" + run_id().replace("-", "_")
        admin = psycopg2.connect(self.dsn())
        admin.autocommit = True
        with admin.cursor() as cur:
            cur.execute(f'CREATE DATABASE "{name}"')
        admin.close()
        return self.dsn(name)

    def test_a_connection_without_tls_is_refused_by_the_server(self):
        with self.assertRaises(psycopg2.OperationalError) as cm:
            psycopg2.connect(f"host=127.0.0.1 port={self.port} user=tally dbname=postgres"
                             " sslmode=disable")
        self.assertIn("no encryption", str(cm.exception))

    def test_a_server_the_trusted_ca_did_not_sign_is_refused_by_tally(self):
        out = self.cli("migrate", env=self.env(TALLY_PG=self.dsn(ca="other-ca.crt")))
        self.assertNotEqual(out.returncode, 0, out.stdout)
        self.assertIn("certificate verify failed", out.stderr)

    def test_workers_run_over_verified_tls(self):
        pg = self.tls_database()
        out = self.cli("migrate", env=self.env(TALLY_PG=pg))  # the cluster's superuser
        self.assertEqual(out.returncode, 0, out.stderr)
        # each worker as the role that migrate created for it (it refuses the superuser)
        self.dispatcher(TALLY_PG=pg.replace("user=tally ", "user=tally_dispatcher "))
        rec = self.start("tally-reconciler",
                         TALLY_PG=pg.replace("user=tally ", "user=tally_reconciler "))
        # ready: started and connected to PostgreSQL, which here means over TLS
        wait_for(lambda: rec.http_get("/readyz")[0] == 200, timeout=30,
                 what="the reconciler ready over TLS")
        run = run_id()
        self.publish(self.intent(run, 1, "charge_card",
                                 {"tenant_id": "t1", "payment_id": f"{run}-p", "amount": 5}))
        db = psycopg2.connect(pg)
        try:
            def status():
                with db.cursor() as cur:
                    cur.execute("SELECT status FROM effects WHERE run_id = %s", (run,))
                    row = cur.fetchone()
                db.commit()
                return row and row[0]
            wait_for(lambda: status() == "CONFIRMED", timeout=30,
                     what="the effect recorded over TLS")
            with db.cursor() as cur:
                # every session of the workers came in over TLS
                cur.execute("SELECT count(*), count(*) FILTER (WHERE s.ssl) FROM pg_stat_activity a"
                            " JOIN pg_stat_ssl s USING (pid) WHERE a.datname = current_database()"
                            " AND a.application_name LIKE 'tally-%'")
                total, tls = cur.fetchone()
            self.assertGreater(total, 0)
            self.assertEqual(tls, total)
        finally:
            db.close()


if __name__ == "__main__":
    main()
