// A minimal test harness for the C++ unit tests (no external framework needed).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

namespace tnt_test {

struct Case {
  const char* name;
  std::function<void()> fn;
};

inline std::vector<Case>& cases() {
  static std::vector<Case> all;
  return all;
}

inline int& failures() {
  static int n = 0;
  return n;
}

struct Register {
  Register(const char* name, std::function<void()> fn) { cases().push_back({name, std::move(fn)}); }
};

inline int run_all() {
  for (const auto& c : cases()) {
    const int before = failures();
    c.fn();
    std::printf("%s %s\n", failures() == before ? "ok  " : "FAIL", c.name);
  }
  std::printf("%zu cases, %d failed checks\n", cases().size(), failures());
  return failures() == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}

}  // namespace tnt_test

#define TNT_TEST(name)                                              \
  static void name();                                               \
  static const tnt_test::Register name##_reg(#name, &name);         \
  static void name()

#define CHECK(cond)                                                              \
  do {                                                                           \
    if (!(cond)) {                                                               \
      std::fprintf(stderr, "%s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond); \
      ++tnt_test::failures();                                                    \
    }                                                                            \
  } while (0)

#define CHECK_THROWS(expr, Exc, fragment)                                               \
  do {                                                                                  \
    bool thrown_ = false;                                                               \
    try {                                                                               \
      (void)(expr);                                                                     \
    } catch (const Exc& e_) {                                                           \
      thrown_ = std::string(e_.what()).find(fragment) != std::string::npos;             \
      if (!thrown_) std::fprintf(stderr, "%s:%d: message: %s\n", __FILE__, __LINE__, e_.what()); \
    }                                                                                   \
    if (!thrown_) {                                                                     \
      std::fprintf(stderr, "%s:%d: %s did not throw %s(%s)\n", __FILE__, __LINE__, #expr, #Exc, fragment); \
      ++tnt_test::failures();                                                           \
    }                                                                                   \
  } while (0)
