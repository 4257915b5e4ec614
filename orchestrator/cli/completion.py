"""`fsdpjob completion SHELL`: the shell's completion script (the completions themselves: shellcomplete.py)."""

from __future__ import annotations

import click

from .options import command


@command()
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
def completion(shell: str) -> None:
    """Print the shell completion script: commands, options, run ids and profile names complete with TAB.

    \b
    bash, in ~/.bashrc:  eval "$(fsdpjob completion bash)"
    zsh, in ~/.zshrc:    eval "$(fsdpjob completion zsh)"
    fish:                fsdpjob completion fish > ~/.config/fish/completions/fsdpjob.fish
    """
    from click.shell_completion import get_completion_class

    # click's own completion: the script calls `fsdpjob` back with _FSDPJOB_COMPLETE set, and click answers.
    group = click.get_current_context().find_root().command  # the fsdpjob group (main.py), not imported here
    click.echo(get_completion_class(shell)(group, {}, "fsdpjob", "_FSDPJOB_COMPLETE").source())
