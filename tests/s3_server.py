"""A real S3-compatible server for the tests and benches: moto's standalone server, as a process of
its own reached over HTTP (optionally inside a network namespace), with a bucket made as a user makes
one by hand; and the environment coordd reads the store's credentials and endpoint from.

With ``auth``, the server checks every request's signature against its own IAM users, as S3 does:
``coord`` may do anything with S3, ``writer`` only put objects; any other key is refused."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ACCESS_KEY, SECRET_KEY, REGION = "coord-test", "coord-test-secret", "us-east-1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class S3Server:
    """``moto_server`` on ``host:port`` (in ``prefix``'s namespace, e.g. ``ip netns exec NS``)."""

    def __init__(self, host: str = "127.0.0.1", port: int | None = None, prefix: list[str] | None = None,
                 auth: bool = False):
        self.host, self.port, self.prefix, self.auth = host, port or free_port(), prefix or [], auth
        self.process: subprocess.Popen[bytes] | None = None
        self.users: dict[str, tuple[str, str]] = {}  # name -> (access key, secret), with auth

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        return self.env_of("coord")

    def env_of(self, user: str) -> dict[str, str]:
        key, secret = self.users.get(user, (ACCESS_KEY, SECRET_KEY))
        return {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret, "AWS_REGION": REGION,
                "AWS_ENDPOINT_URL": self.endpoint}

    def start(self, buckets: tuple[str, ...] = ("ckpt",)) -> S3Server:
        server = str(Path(sys.executable).with_name("moto_server"))
        # moto lets this many requests through unchecked (the bucket, the users and their keys), then
        # checks every one.
        setup = len(buckets) + (6 if self.auth else 0)
        env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": str(setup)} if self.auth else None
        self.process = subprocess.Popen([*self.prefix, server, "-H", self.host, "-p", str(self.port)], env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not self._answers():
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError(f"moto_server did not start on {self.endpoint}")
            time.sleep(0.2)
        if self.prefix:  # the server is reached from its namespace only: the bucket is made from there
            make = (f"import boto3; c = boto3.client('s3', endpoint_url={self.endpoint!r}, region_name={REGION!r}, "
                    f"aws_access_key_id={ACCESS_KEY!r}, aws_secret_access_key={SECRET_KEY!r})\n"
                    + "".join(f"c.create_bucket(Bucket={bucket!r})\n" for bucket in buckets))
            subprocess.run([*self.prefix, sys.executable, "-c", make], check=True, capture_output=True)
        else:
            for bucket in buckets:
                self.client().create_bucket(Bucket=bucket)
        if self.auth:
            assert not self.prefix, "IAM users are made from this process: a server beside it"
            for user, actions in (("coord", "s3:*"), ("writer", "s3:PutObject")):
                iam = self.client("iam")
                iam.create_user(UserName=user)
                iam.put_user_policy(UserName=user, PolicyName="store", PolicyDocument=json.dumps({
                    "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": actions, "Resource": "*"}]}))
                made = iam.create_access_key(UserName=user)["AccessKey"]
                self.users[user] = (made["AccessKeyId"], made["SecretAccessKey"])
        return self

    def _answers(self) -> bool:
        probe = [*self.prefix, sys.executable, "-c",
                 f"import socket; socket.create_connection(({self.host!r}, {self.port}), timeout=1).close()"]
        if not self.prefix:
            try:
                socket.create_connection((self.host, self.port), timeout=1).close()
                return True
            except OSError:
                return False
        return subprocess.run(probe, capture_output=True).returncode == 0

    def client(self, service: str = "s3"):  # noqa: ANN201 - boto3's (moto's own dependency), as a user makes one
        import boto3

        key, secret = self.users.get("coord", (ACCESS_KEY, SECRET_KEY))
        return boto3.client(service, endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id=key,
                            aws_secret_access_key=secret)

    def pause(self) -> None:
        """The server stops answering (its connections stay open): a store that hangs."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
