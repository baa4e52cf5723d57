import os
import sys

# Tests import the harness as tests.harness and rank functions as tests.multirank.<module>.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
