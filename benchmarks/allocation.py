"""Allocation efficiency in simulation: the README table (three populations x uniform / DS / SARA, 5 seeds).

Run: python benchmarks/allocation.py [OUT_DIR]   (same as `sara bench allocation` per population; JSON + PNG each)
"""

import sys

from sara.cli import main

if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "runs/bench-allocation"
    for population in ("u-shaped", "mid-training", "uniform"):
        print(f"\n## population: {population}")
        main(["bench", "allocation", "--population", population, "--k", "8", "--seeds", "5",
              "--allocators", "uniform;ds;sara_paper:tau_low=0.45,probe=1;sara_paper:tau_low=0.45,probe=2/1",
              "--json", f"{out}/{population}.json"])
    print("\n## decision throughput")
    main(["bench", "decisions", "--units", "1000000"])
