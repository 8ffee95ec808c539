"""`coord preflight`: the report on screen (the checks themselves are in coordinator.readiness.preflight)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for the checker only: the CLI draws the report without the daemon's modules
    from rich.console import Console

    from coordinator.readiness.preflight import PreflightReport


def render_preflight(result: PreflightReport, console: Console) -> None:
    from rich.table import Table

    marks = {"pass": "[green]pass[/]", "warn": "[yellow]warn[/]", "fail": "[red]FAIL[/]"}
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("LAYER", "CHECK", "STATUS", "DETAIL"):
        table.add_column(column, overflow="fold")
    for item in result["checks"]:
        table.add_row(item["layer"], item["name"], marks[item["status"]], item["detail"])
    console.print(table)
    fixes = [c for c in result["checks"] if c["status"] != "pass" and c.get("fix_command")]
    if fixes:
        console.print("\n[bold]to fix[/]")
        for item in fixes:
            console.print(f"  {item['name']}: {item['fix_command']}", soft_wrap=True, markup=False, highlight=False)
    torch = result.get("torch")
    if torch and torch["envs"]:
        console.print("\n[bold]each node's PyTorch environment[/] (a torch launcher sets it; the job's own wins)")
        for node, env in sorted(torch["envs"].items()):
            words = " ".join(f"{key}={value}" for key, value in sorted(env.items()))
            console.print(f"  {node}: {words}", soft_wrap=True, markup=False, highlight=False)
    console.print(f"\npre-flight: {marks[result['status']]} ({result['seconds']:.1f} s)")
