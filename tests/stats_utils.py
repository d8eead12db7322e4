"""Statistics shared by the sampler tests (scipy is not a dependency)."""
import torch


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; p = Q(df/2, X/2) (regularized upper gamma)."""
    n = counts.sum().double()
    exp = probs.double() * n
    cells = exp > 0
    if (counts[~cells] > 0).any():
        return 0.0                      # a count where the model says impossible
    x2 = ((counts[cells].double() - exp[cells]) ** 2 / exp[cells]).sum()
    df = int(cells.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), x2 / 2))
