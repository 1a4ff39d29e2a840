"""A budget chooser's default lane (in-process decoding at batch size 1) as tests read it, through the chooser's
public behaviour: the lane's decision (`decisions[""]`) and a builder sized by its next plan (`plan`)."""

from treeserve.engine.budget import BudgetChooser, Decision


def decision(chooser: BudgetChooser) -> Decision:
    """The default lane's decision: the budget decided (`current`), plain steps held, records still owed."""
    return chooser.decisions[""]


def builder_for(chooser: BudgetChooser, builder):
    """`builder` with the chooser's next budget for the default lane (a chain's length), or None for a plain
    step; builders without a budget are unchanged."""
    plan = chooser.plan()
    return None if plan.plain else BudgetChooser.resized(builder, plan.budget)
