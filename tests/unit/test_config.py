"""Configuration and the command line: values, precedence, and clear errors."""

from __future__ import annotations

import pytest

from relay.cli import build_parser, main, parse
from relay.config import (
    RUN_OPTIONS,
    Config,
    build_config,
    parse_duration,
    parse_nats_urls,
    parse_table_name,
    redact_url,
)
from relay.database import connection_string
from relay.errors import ConfigError, SetupError


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("250ms", 0.25), ("1.5", 1.5), ("30s", 30), ("5m", 300), ("2h", 7200), ("7d", 604800)],
)
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "-1s", "1w", "s", "1 s s", "abc"])
def test_bad_durations(text):
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)


def test_table_names():
    assert parse_table_name("outbox_events") == ("outbox_events",)
    assert parse_table_name("billing.outbox") == ("billing", "outbox")
    for bad in ("a.b.c", "", "drop table x;", "1abc", 'a"b'):
        with pytest.raises(ValueError, match="not a table name"):
            parse_table_name(bad)


def test_nats_urls_are_comma_separated():
    assert parse_nats_urls("nats://a:4222, nats://b:4222") == ("nats://a:4222", "nats://b:4222")
    with pytest.raises(ValueError, match="not a nats:// URL"):
        parse_nats_urls("http://a:4222")
    with pytest.raises(ValueError, match="bad port"):
        parse_nats_urls("nats://a:99999")


def test_redaction_hides_only_the_password():
    assert redact_url("postgresql://u:pw@h:5432/db") == "postgresql://u:***@h:5432/db"
    assert redact_url("postgresql://u@h/db") == "postgresql://u@h/db"
    assert redact_url("nats://tok:sec@h:4222") == "nats://tok:***@h:4222"


def test_flag_beats_environment_beats_default():
    env = {"OUTBOX_RELAY_BATCH_SIZE": "100", "OUTBOX_RELAY_POLL_INTERVAL": "2s"}
    config = build_config({"batch_size": "50"}, env, RUN_OPTIONS)
    assert config.batch_size == 50
    assert config.poll_interval == 2.0
    assert config.publish_timeout == Config().publish_timeout


def test_required_environment_variables_are_read():
    env = {
        "OUTBOX_RELAY_DATABASE_URL": "postgresql://db.example/x",
        "OUTBOX_RELAY_NATS_URL": "nats://n1:4222,nats://n2:4222",
        "OUTBOX_RELAY_METRICS_PORT": "9100",
    }
    _, config = parse(["run"], env)
    assert config.database_url == "postgresql://db.example/x"
    assert config.nats_urls == ("nats://n1:4222", "nats://n2:4222")
    assert config.metrics_port == 9100


@pytest.mark.parametrize(
    ("argv", "env", "names"),
    [
        (["run", "--batch-size", "-5"], {}, "--batch-size"),
        (["run", "--batch-size", "many"], {}, "--batch-size"),
        (["run"], {"OUTBOX_RELAY_BATCH_SIZE": "0"}, "OUTBOX_RELAY_BATCH_SIZE"),
        (["run", "--database-url", "mysql://x"], {}, "--database-url"),
        (["run", "--nats-url", "localhost:4222"], {}, "--nats-url"),
        (["run", "--metrics-port", "70000"], {}, "--metrics-port"),
        (["run", "--poll-interval", "0s"], {}, "--poll-interval"),
        (["run", "--table", "x;drop"], {}, "--table"),
        (["run", "--log-format", "xml"], {}, "--log-format"),
        (["run"], {"OUTBOX_RELAY_FAILPOINTS": "crash-somewhere"}, "OUTBOX_RELAY_FAILPOINTS"),
        (["run", "--backoff-base", "10s", "--backoff-max", "1s"], {}, "--backoff-max"),
    ],
)
def test_bad_values_fail_with_one_line_naming_the_option(capsys, argv, env, names):
    assert main(argv, env) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"outbox-relay: error: {names}:")
    assert "Traceback" not in err[0]


def test_passwords_never_appear_in_config_errors(capsys):
    assert main(["run", "--database-url", "mysql://u:hunter2@h/db"], {}) == 2
    assert "hunter2" not in capsys.readouterr().err
    assert main(["run", "--nats-url", "http://u:hunter2@h:4222"], {}) == 2
    assert "hunter2" not in capsys.readouterr().err


def test_help_shows_every_option_with_its_variable_and_default():
    text = build_parser()._subparsers._group_actions[0].choices["run"].format_help()
    flat = " ".join(text.split())
    for option in RUN_OPTIONS:
        assert (option.flag in flat) is not option.test_only
        assert (option.env in flat) is not option.test_only
    assert "default 500" in flat
    assert "default 1s" in flat


def test_failpoints_are_a_variable_for_the_tests_never_a_flag(capsys):
    _, config = parse(["run"], {"OUTBOX_RELAY_FAILPOINTS": "crash-after-mark"})
    assert config.failpoints == {"crash-after-mark"}
    with pytest.raises(SystemExit):
        parse(["run", "--failpoints", "crash-after-mark"], {})
    assert "unrecognized arguments: --failpoints" in capsys.readouterr().err


def test_config_error_names_the_option():
    with pytest.raises(ConfigError) as caught:
        build_config({"batch_size": "-1"}, {}, RUN_OPTIONS)
    assert caught.value.option == "--batch-size"


def test_skip_names_its_rows_and_takes_the_operator_options(capsys):
    # Giving up on rows is never done wholesale: --id is required, and a bad one is
    # refused before anything connects.
    with pytest.raises(SystemExit) as exited:
        main(["skip"], {})
    assert exited.value.code == 2
    assert "--id" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["skip", "--id", "not-a-uuid"], {})
    assert "not a uuid" in capsys.readouterr().err
    args, config = parse(
        ["skip", "--id", "0192c8e4-3a51-7c6e-9d0b-5f3e2a1b4c7d", "--max-attempts", "5"], {}
    )
    assert [str(i) for i in args.id] == ["0192c8e4-3a51-7c6e-9d0b-5f3e2a1b4c7d"]
    assert config.max_attempts == 5
    assert not args.execute


def test_urls_can_come_from_mounted_secret_files(tmp_path, capsys):
    secret = tmp_path / "database-url"
    secret.write_text("postgresql://relay:s3cret-pw@db:5432/app?sslmode=verify-full\n")
    _, config = parse(["run"], {"OUTBOX_RELAY_DATABASE_URL_FILE": str(secret)})
    assert config.database_url == "postgresql://relay:s3cret-pw@db:5432/app?sslmode=verify-full"
    nats = tmp_path / "nats-url"
    nats.write_text("nats://relay:n4ts-pw@nats-1:4222,nats://relay:n4ts-pw@nats-2:4222")
    _, config = parse(["run"], {"OUTBOX_RELAY_NATS_URL_FILE": str(nats)})
    assert config.nats_urls == (
        "nats://relay:n4ts-pw@nats-1:4222",
        "nats://relay:n4ts-pw@nats-2:4222",
    )
    # Both the variable and its file: which one was meant is unknown, so neither.
    assert main(["run"], {"OUTBOX_RELAY_DATABASE_URL": "postgresql://x@db/app",
                          "OUTBOX_RELAY_DATABASE_URL_FILE": str(secret)}) == 2  # fmt: skip
    assert "not both" in capsys.readouterr().err
    # A file that cannot be read is named, and what the readable one holds never shown.
    assert main(["run"], {"OUTBOX_RELAY_DATABASE_URL_FILE": str(tmp_path / "missing")}) == 2
    err = capsys.readouterr().err
    assert "OUTBOX_RELAY_DATABASE_URL_FILE" in err
    assert "No such file" in err
    # --help shows defaults only, and the NATS URLs redacted however they are given.
    assert "s3cret" not in build_parser().format_help()


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://relay:hunter2@db/outbox", "postgresql://relay:***@db/outbox"),
        ("postgresql://relay@db/outbox?password=hunter2&sslmode=require",
         "postgresql://relay@db/outbox?password=***&sslmode=require"),
        ("postgresql://db/outbox?sslpassword=hunter2&sslkey=/k.pem",
         "postgresql://db/outbox?sslpassword=***&sslkey=/k.pem"),
        ("host=db password=hunter2 dbname=outbox", "host=db password=*** dbname=outbox"),
        ("host=db password='hunter 2' sslpassword = hunter2",
         "host=db password=*** sslpassword=***"),
        ("postgresql://db/outbox?application_name=x", "postgresql://db/outbox?application_name=x"),
    ],
)  # fmt: skip
def test_every_form_of_a_database_secret_is_redacted(url, shown):
    assert redact_url(url) == shown
    assert "hunter" not in redact_url(url)


def test_the_configs_repr_holds_no_secret():
    config = Config(database_url="postgresql://u:hunter2@db/x", nats_token="hunter3")
    assert "hunter" not in repr(config)


def test_an_unparsable_database_url_is_reported_without_the_token_it_stumbled_on():
    with pytest.raises(SetupError) as caught:
        connection_string("host=db hunter2")
    assert "hunter2" not in str(caught.value)
    assert "cannot be parsed" in str(caught.value)
