// The doctest main shared by every test executable, with one addition: a run given a test-case
// filter (-tc / --test-case, as ctest runs one case by name) that selects no case fails, naming
// the filter, instead of passing having run nothing. (A ';' in a case name once split ctest's
// list of names, and each half ran nothing and was reported passed.)
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <string>

namespace {

int g_selected = -1;  // cases that passed the filters in the last run

struct SelectedCount : doctest::IReporter {
  explicit SelectedCount(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats& s) override { g_selected = int(s.numTestCasesPassingFilters); }
  void test_case_start(const doctest::TestCaseData&) override {}
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats&) override {}
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};
REGISTER_LISTENER("selected_count", 1, SelectedCount);

// The value of the last -tc / --test-case option (doctest also takes a dt- prefix), or "".
std::string case_filter(int argc, char** argv) {
  std::string filter;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--dt-", 0) == 0 || a.rfind("-dt-", 0) == 0) a.erase(a.find("dt-"), 3);
    for (const char* opt : {"-tc=", "--test-case="})
      if (a.rfind(opt, 0) == 0) filter = a.substr(std::string(opt).size());
  }
  return filter;
}

}  // namespace

int main(int argc, char** argv) {
  doctest::Context context(argc, argv);
  const int rc = context.run();
  if (context.shouldExit()) return rc;  // --help, --list-test-cases and the like ran no cases
  const std::string filter = case_filter(argc, argv);
  if (rc == 0 && !filter.empty() && g_selected == 0) {
    std::fprintf(stderr, "[doctest] no test case matches --test-case=%s: nothing ran\n", filter.c_str());
    return 1;
  }
  return rc;
}
