// moegemm's environment variables on the C++ side, with the rules of moegemm/_env.py. A boolean: 1/0, true/false,
// yes/no, on/off (any case, surrounding blanks ignored); unset or empty is the default; anything else throws
// std::invalid_argument naming the variable (so that "false" never reads as on). A choice: one of its names (any
// case, blanks ignored), likewise. Host code only, no CUDA header.
#pragma once

#include <cctype>
#include <cstdlib>
#include <initializer_list>
#include <stdexcept>
#include <string>

namespace moegemm {

// `value` without surrounding blanks, in lower case ("" for unset).
inline std::string normalized_env_value(const char* value) {
  if (value == nullptr) return "";
  std::string v(value);
  const auto first = v.find_first_not_of(" \t\r\n");
  if (first == std::string::npos) return "";
  v = v.substr(first, v.find_last_not_of(" \t\r\n") - first + 1);
  for (char& c : v) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return v;
}

inline bool parse_env_flag(const char* env, const char* value, bool default_value) {
  const std::string v = normalized_env_value(value);
  if (v.empty()) return default_value;
  if (v == "1" || v == "true" || v == "yes" || v == "on") return true;
  if (v == "0" || v == "false" || v == "no" || v == "off") return false;
  throw std::invalid_argument(std::string("environment variable ") + env + "='" + value +
                              "' is not a boolean: use one of 1/true/yes/on or 0/false/no/off (any case), or leave "
                              "it unset");
}

// The boolean environment variable `env`, `default_value` when unset or empty.
inline bool env_flag(const char* env, bool default_value) {
  return parse_env_flag(env, std::getenv(env), default_value);
}

// The index of `value` among `names` (lower case), -1 when unset or empty; anything else throws.
inline int parse_env_choice(const char* env, const char* value, std::initializer_list<const char*> names) {
  const std::string v = normalized_env_value(value);
  if (v.empty()) return -1;
  std::string listed;
  int i = 0;
  for (const char* name : names) {
    if (v == name) return i;
    listed += (i++ ? ", " : "") + std::string(name);
  }
  throw std::invalid_argument(std::string("environment variable ") + env + "='" + value + "' must be one of " +
                              listed + ", or unset");
}

// The choice environment variable `env`: its index among `names`, -1 when unset or empty.
inline int env_choice(const char* env, std::initializer_list<const char*> names) {
  return parse_env_choice(env, std::getenv(env), names);
}

}  // namespace moegemm
