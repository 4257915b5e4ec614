"""`fsdpjob dev-cluster up|down|status`: a real local Slurm cluster for trying fsdpjob and for its tests.

Errors are FsdpjobError, formatted by the main CLI like every other command's."""

from __future__ import annotations

import click

from . import manage

_STATE_DIR = click.option(
    "--state-dir", type=click.Path(file_okay=False), default=None, envvar="FSDPJOB_DEVCLUSTER_DIR",
    show_envvar=True,
    help="Where the cluster keeps config, logs, spool and database [default: /tmp/fsdpjob-devcluster].")


@click.group(name="dev-cluster", short_help="A real multi-node Slurm cluster on this machine, for tests (root only).")
def dev_cluster() -> None:
    """A real local Slurm cluster on this machine (root only): munge, slurmctld, nodes n1..nN (2 by default)
    with 4 CPUs and 2 fake GPUs each, partitions debug (preemptible) and high on n1, n2 (plus `wide` on all
    nodes when there are more than 2), and sacct via slurmdbd."""


@dev_cluster.command()
@click.option("--no-accounting", is_flag=True, help="Skip MariaDB + slurmdbd (faster, lighter; no sacct).")
@click.option("--port-base", type=click.IntRange(1024, 65000), default=None,
              help="First of the private ports (default 16810): slurmctld at the base, slurmdbd +1, MariaDB +2, "
                   "node nK +2+K; give a second cluster a base at least 20 away.")
@click.option("--nodes", type=click.IntRange(2, 8), default=None,
              help="Emulated nodes n1..nN [default: as the running cluster, else 2]. With more than 2, "
                   "partition `wide` spans them all; debug and high stay on n1, n2.")
@click.option("--containers", is_flag=True,
              help="Also a test image without Slurm (run by bubblewrap in each task, profile "
                   "test-cluster-container); prints `export FSDPJOB_TEST_IMAGE=...` too.")
@_STATE_DIR
def up(no_accounting: bool, port_base: int | None, nodes: int | None, containers: bool, state_dir: str | None) -> None:
    """Start the cluster (a no-op if it runs) and print `export SLURM_CONF=...` for `eval`."""
    info = manage.up(accounting=not no_accounting, state_dir=state_dir, port_base=port_base, nodes=nodes,
                     containers=containers, echo=True)
    click.echo(f"export SLURM_CONF={info.slurm_conf}")
    if info.image is not None:
        click.echo(f"export FSDPJOB_TEST_IMAGE={info.image}")


@dev_cluster.command()
@click.option("--purge", is_flag=True, help="Also delete the state dir (job history, database, logs).")
@_STATE_DIR
def down(purge: bool, state_dir: str | None) -> None:
    """Cancel all jobs and stop the cluster's daemons."""
    manage.down(state_dir=state_dir, purge=purge, echo=True)


@dev_cluster.command()
@_STATE_DIR
def status(state_dir: str | None) -> None:
    """Show which daemons run, the nodes and the queue."""
    click.echo(manage.status(state_dir=state_dir), nl=False)
